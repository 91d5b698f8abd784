"""The demo model's tokenizer: a byte-level BPE trained on the corpus's training slice.

The pipeline is the one transformers' Qwen tokenizers build (NFC, Qwen's split regex, byte-level
bytes-to-unicode, byte-level decoding), as in synth's tokenizer; the BPE is trained here with the
`tokenizers` library on the training files only (the held-out slice never shapes the vocabulary),
which is deterministic for a given corpus. Qwen's special-token block follows the BPE tokens, then
reserved specials up to vocab_size, and the chat template is synth's Qwen-style one (tools,
<tool_call> JSON, thinking).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from flashpack.convert.synth.special_tokens import NOT_SKIPPED_ON_DECODE, TokenIds
from flashpack.convert.synth.tokenizer import PRETOKENIZE_REGEX, chat_template
from flashpack.errors import FlashpackError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def train_tokenizer(texts: Iterable[str], tokens: TokenIds) -> Tokenizer:
    """A BPE with tokens.base regular tokens learned from `texts`, then the special block."""
    tokenizer = _qwen_pipeline()
    trainer = trainers.BpeTrainer(
        vocab_size=tokens.base,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    regular = tokenizer.get_vocab_size(with_added_tokens=False)
    if regular != tokens.base:
        raise FlashpackError(
            f"the corpus yields only {regular} BPE tokens, fewer than the {tokens.base} the vocabulary needs"
        )
    tokenizer.add_tokens(
        [AddedToken(text, special=text not in NOT_SKIPPED_ON_DECODE, normalized=False) for text in tokens.all_specials()]
    )
    if tokenizer.get_vocab_size(with_added_tokens=True) != tokens.vocab_size:
        raise AssertionError("tokenizer length differs from vocab_size")  # a bug here, not a user error
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, folder: Path, tokens: TokenIds, model_max_length: int) -> None:
    """tokenizer.json and a Qwen2Tokenizer tokenizer_config.json carrying the chat template."""
    tokenizer.save(str(folder / "tokenizer.json"))
    decoder = {
        str(tokens.base + offset): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": text not in NOT_SKIPPED_ON_DECODE,
        }
        for offset, text in enumerate(tokens.all_specials())
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": decoder,
        "chat_template": chat_template(),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


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


def _qwen_pipeline() -> Tokenizer:
    tokenizer = Tokenizer(
        models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer
