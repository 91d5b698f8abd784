"""The evaluation documents, built from the demo model's held-out slice (nothing downloaded).

The held-out files are convert/train/corpus.py's: the Python files of the installed transformers
5.23 whose path's xxh64 is 0 modulo 50, in path order. Two sets, both deterministic:

- code documents: each held-out file cut at line ends into pieces of at most DOCUMENT_BYTES (about
  1,000 tokens at the demo tokenizer's 4.5 bytes a token, like the 1,024-token windows of the training
  record's held-out loss); joined, a file's pieces are the file byte for byte.
- next-line items: up to ITEMS_PER_FILE lines of each file, picked by a generator seeded with the
  file's path. The context is the file's text before the line (at most CONTEXT_BYTES of whole lines);
  the choices are the true line and DISTRACTORS other lines of the same file, drawn from the
  2 x DISTRACTORS closest to it in length and given its indentation (so that neither length nor
  indentation gives it away: a log-likelihood summed over a line favours short lines), in a seeded order.

  lm-eval scores a choice as the tokens of context + choice after the context's own tokens, so a
  token merged across the cut (`,` + `\n` is one token) would be lost to every choice. The context
  therefore ends at its last letter or digit, where the tokenizer's pre-split always cuts, and what
  follows it (the previous line's punctuation, its newline) opens every choice.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from flashpack.convert.train.corpus import SourceFile, load_corpus

DOCUMENT_BYTES = 4096
CONTEXT_BYTES = 1536
ITEMS_PER_FILE = 3
DISTRACTORS = 3
MIN_LINE_CHARACTERS = 12  # a line this long (stripped) says something of its own
FIRST_LINE = 8  # lines before this are licence headers and imports, much alike across files


@dataclass(frozen=True)
class NextLine:
    path: str
    line: int  # 0-based, in the file
    context: str  # ends with a letter or digit
    choices: tuple[str, ...]  # each the rest of the line before, then a whole line, "\n" included
    gold: int

    def as_dict(self) -> dict:
        return {"path": self.path, "line": self.line, "context": self.context, "choices": list(self.choices),
                "gold": self.gold}


def held_out_files(max_files: int | None = None) -> tuple[SourceFile, ...]:
    return load_corpus(max_train_files=0, max_held_out_files=max_files).held_out


def code_documents(files: tuple[SourceFile, ...]) -> list[dict]:
    """{"path", "piece", "text"} for every piece of every file, in order."""
    return [{"path": source.path, "piece": index, "text": text}
            for source in files for index, text in enumerate(_pieces(source.text))]


def next_line_items(files: tuple[SourceFile, ...]) -> list[NextLine]:
    return [item for source in files for item in _items(source)]


def _pieces(text: str) -> Iterator[str]:
    piece, size = [], 0
    for line in text.splitlines(keepends=True):
        length = len(line.encode())
        if piece and size + length > DOCUMENT_BYTES:
            yield "".join(piece)
            piece, size = [], 0
        piece.append(line)
        size += length
    if piece:
        yield "".join(piece)


def _items(source: SourceFile) -> Iterator[NextLine]:
    lines = source.text.splitlines(keepends=True)
    candidates = [i for i in range(FIRST_LINE, len(lines)) if len(lines[i].strip()) >= MIN_LINE_CHARACTERS]
    rng = random.Random(xxhash.xxh64(source.path.encode()).intdigest())
    for line in sorted(rng.sample(candidates, min(ITEMS_PER_FILE, len(candidates)))):
        true = _whole(lines[line])
        others = sorted({lines[i].strip() for i in candidates if lines[i].strip() != true.strip()})
        if len(others) < DISTRACTORS:
            continue
        indent = true[: len(true) - len(true.lstrip())]
        nearest = sorted(others, key=lambda text: (abs(len(text) - len(true.strip())), text))[: 2 * DISTRACTORS]
        choices = [true] + [indent + text + "\n" for text in rng.sample(nearest, DISTRACTORS)]
        order = list(range(len(choices)))
        rng.shuffle(order)
        context, tail = _cut(_context(lines, line))
        yield NextLine(source.path, line, context, tuple(tail + choices[i] for i in order), order.index(0))


def _whole(line: str) -> str:
    return line.rstrip("\r\n") + "\n"


def _context(lines: list[str], line: int) -> str:
    kept, size = [], 0
    for previous in reversed(lines[:line]):
        size += len(previous.encode())
        if kept and size > CONTEXT_BYTES:
            break
        kept.append(previous)
    return "".join(reversed(kept))


def _cut(text: str) -> tuple[str, str]:
    """(text up to its last letter or digit, the rest)."""
    end = len(text)
    while end and not text[end - 1].isalnum():
        end -= 1
    return text[:end], text[end:]
