"""The demo model's tokenizer: a byte-level BPE trained on the corpus's training slice.

The pipeline is the one transformers' Qwen tokenizers build (NFC, Qwen's split regex, byte-level
bytes-to-unicode, byte-level decoding), as in synth's tokenizer; the BPE is trained here with the
`tokenizers` library on the training files only (the held-out slice never shapes the vocabulary),
which is deterministic for a given corpus. Qwen's special-token block follows the BPE tokens, then
reserved specials up to vocab_size, and the chat template is synth's Qwen-style one (tools,
<tool_call> JSON, thinking).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer

from flashpack.convert.synth.special_tokens import TokenIds
from flashpack.convert.synth.tokenizer import add_specials, bpe_trainer, qwen_pipeline
from flashpack.errors import FlashpackError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def train_tokenizer(texts: Iterable[str], tokens: TokenIds) -> Tokenizer:
    """A BPE with tokens.base regular tokens learned from `texts`, then the special block."""
    tokenizer = qwen_pipeline()
    tokenizer.train_from_iterator(texts, trainer=bpe_trainer(tokens))
    regular = tokenizer.get_vocab_size(with_added_tokens=False)
    if regular != tokens.base:
        raise FlashpackError(
            f"the corpus yields only {regular} BPE tokens, fewer than the {tokens.base} the vocabulary needs"
        )
    return add_specials(tokenizer, tokens)


def load_tokenizer(folder: Path, tokens: TokenIds) -> Tokenizer:
    """A tokenizer saved by `save_tokenizer`, checked against the vocabulary it must fit."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise FlashpackError(f"{folder} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(path))
    if tokenizer.get_vocab_size(with_added_tokens=True) != tokens.vocab_size:
        raise FlashpackError(
            f"{path} has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens, the model {tokens.vocab_size}"
        )
    if tokenizer.token_to_id("<|endoftext|>") != tokens.endoftext:
        raise FlashpackError(f"{path} does not place <|endoftext|> at id {tokens.endoftext}")
    return tokenizer
