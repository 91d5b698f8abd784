"""What the bench reads: the trainer's held-out slice, cut the trainer's way, and its baseline.

The held-out files are convert/train/corpus.py's (66 files of transformers 5.23's sources, fixed by
their paths' xxh64); they become one token stream and windows of T + 2 tokens exactly as the
trainer evaluated them (convert/train/windows.py). A run reads a fixed, evenly spaced subset of the
windows: window i * count // n for i < n. The unigram baseline is convert/train/evaluate.py's
(training-slice counts, add-one smoothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from flashpack.convert.train.corpus import Corpus, SourceFile
from flashpack.convert.train.evaluate import unigram_log_probs
from flashpack.convert.train.windows import Windows, token_stream
from flashpack.errors import FlashpackError

ENDOFTEXT = "<|endoftext|>"  # the config's eos: files are joined with it, PLE's n-grams restart there


@dataclass(frozen=True)
class TextModel:
    """A snapshot's tokenizer (the trainer's `tokenizers` object) and the eos id files end with."""

    tokenizer: Tokenizer
    eos: int

    @classmethod
    def load(cls, snapshot: Path) -> "TextModel":
        tokenizer = Tokenizer.from_file(str(Path(snapshot) / "tokenizer.json"))
        eos = tokenizer.token_to_id(ENDOFTEXT)
        if eos is None:
            raise FlashpackError(f"{snapshot}'s tokenizer has no {ENDOFTEXT}")
        return cls(tokenizer, eos)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@dataclass(frozen=True)
class HeldOutWindows:
    indices: list[int]  # which of the slice's windows, in order
    windows: list[torch.Tensor]  # int64 [T + 2] each
    total: int  # windows the whole held-out slice makes
    length: int  # T

    def describe(self) -> dict:
        return {"length": self.length, "read": len(self.indices), "of": self.total, "indices": self.indices,
                "targets": len(self.indices) * self.length, "rule": "window i * total // read, i < read"}


def held_out_windows(text: TextModel, corpus: Corpus, count: int | None, length: int) -> HeldOutWindows:
    """`count` evenly spaced held-out windows of `length` + 2 tokens (all of them when None)."""
    windows = Windows(token_stream(text.tokenizer, [s.text for s in corpus.held_out], text.eos), length)
    read = windows.count if count is None else min(count, windows.count)
    indices = sorted({i * windows.count // read for i in range(read)})
    picked = windows.batch(torch.tensor(indices))
    return HeldOutWindows(indices, list(picked), windows.count, length)


def spread(items: tuple, count: int) -> list:
    """`count` of `items`, evenly spaced over them (deterministic)."""
    count = min(count, len(items))
    return [items[i * len(items) // count] for i in range(count)]


def code_text(source: SourceFile) -> str:
    """The file from its first line that is neither blank nor a comment: past the licence header,
    which every file shares nearly word for word."""
    lines = source.text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")), len(lines))
    return "".join(lines[start:])


def file_prompts(text: TextModel, files: tuple[SourceFile, ...], count: int, tokens: int) -> list[tuple[str, list[int]]]:
    """(path, the first `tokens` ids of its code_text) of `count` files spread over those that
    have more tokens than that."""
    encoded = [(source.path, text.encode(code_text(source))) for source in files]
    long_enough = tuple((path, ids[:tokens]) for path, ids in encoded if len(ids) > tokens)
    return spread(long_enough, count)


def unigram_baseline(text: TextModel, corpus: Corpus, vocab_size: int) -> tuple[torch.Tensor, dict]:
    """(log-probabilities [vocab], what they were counted from) over the corpus's training files."""
    stream = token_stream(text.tokenizer, [s.text for s in corpus.train], text.eos)
    return unigram_log_probs(stream, vocab_size), {"train_files": len(corpus.train), "train_tokens": stream.numel()}
