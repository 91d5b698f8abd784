"""A small but real Qwen-style tokenizer whose length equals the config's vocab_size exactly.

A byte-level BPE is trained (well under a second) on `corpus.json`, an embedded English + code
sample, with the pre-tokenizer, normaliser and decoder transformers' Qwen tokenizers build, so the
files load the same way through any tokenizer class. A corpus that small runs out of merges long
before a 248k vocabulary, so the rest is filled deterministically with merges of existing tokens
(valid BPE: every token stays reachable by merges). The Qwen special-token block follows, then
reserved specials up to vocab_size. The chat template (`chat_template.jinja`) is Qwen-style:
system/user/assistant/tool turns, tools listed in the system turn, <tool_call> JSON, and an
`enable_thinking` switch.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from flashpack.convert.synth.special_tokens import NOT_SKIPPED_ON_DECODE, TokenIds
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

# The split transformers' Qwen3.5 tokenizer uses: contractions, letter runs, single digits, punctuation runs.
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_PACKAGE = "flashpack.convert.synth"
_BPE_OPTIONS = {
    "unk_token": None,
    "continuing_subword_prefix": "",
    "end_of_word_suffix": "",
    "fuse_unk": False,
    "byte_fallback": False,
}


def chat_template() -> str:
    return (resources.files(_PACKAGE) / "chat_template.jinja").read_text()


def bpe_trainer(tokens: TokenIds) -> trainers.BpeTrainer:
    """A byte-level BPE trainer for tokens.base regular tokens (the specials come after)."""
    return trainers.BpeTrainer(
        vocab_size=tokens.base,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )


def qwen_pipeline(model: models.BPE | None = None) -> Tokenizer:
    """A tokenizer with the normaliser, pre-tokenizer and decoder transformers' Qwen tokenizers
    build, around `model` (an empty BPE to train when None)."""
    tokenizer = Tokenizer(model or models.BPE(**_BPE_OPTIONS))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def add_specials(tokenizer: Tokenizer, tokens: TokenIds) -> Tokenizer:
    """Qwen's special-token block after the BPE tokens, then reserved specials up to vocab_size."""
    tokenizer.add_tokens(
        [
            AddedToken(text, special=text not in NOT_SKIPPED_ON_DECODE, normalized=False)
            for text in tokens.all_specials()
        ]
    )
    if tokenizer.get_vocab_size(with_added_tokens=True) != tokens.vocab_size:
        raise AssertionError("tokenizer length differs from vocab_size")  # a bug here, not a user error
    return tokenizer


def build_tokenizer(tokens: TokenIds) -> Tokenizer:
    trained = qwen_pipeline()
    trained.train_from_iterator(_corpus(), trainer=bpe_trainer(tokens))
    vocab, merges = _filled(trained, tokens.base)
    tokenizer = qwen_pipeline(models.BPE(vocab=vocab, merges=merges, **_BPE_OPTIONS))
    del vocab, merges  # a 248k vocabulary costs ~100 MB of Python objects; keep the peak low
    return add_specials(tokenizer, tokens)


def write_tokenizer(folder: Path, tokens: TokenIds, model_max_length: int) -> None:
    save_tokenizer(build_tokenizer(tokens), folder, tokens, model_max_length)


def save_tokenizer(tokenizer: Tokenizer, folder: Path, tokens: TokenIds, model_max_length: int) -> None:
    """tokenizer.json and a Qwen2Tokenizer tokenizer_config.json carrying the chat template."""
    tokenizer.save(str(folder / "tokenizer.json"))
    decoder = {}
    for offset, text in enumerate(tokens.all_specials()):
        decoder[str(tokens.base + offset)] = {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": text not in NOT_SKIPPED_ON_DECODE,
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


def _corpus() -> list[str]:
    return json.loads((resources.files(_PACKAGE) / "corpus.json").read_text())["texts"]


def _filled(trained: Tokenizer, size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The trained vocabulary and merges, extended with merges of existing token pairs (in id
    order) until the BPE has `size` tokens."""
    state = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = state["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    pieces = sorted(vocab, key=vocab.__getitem__)
    for left in pieces:
        if len(vocab) >= size:
            break
        for right in pieces:
            if len(vocab) >= size:
                break
            merged = left + right
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((left, right))
    return vocab, merges
