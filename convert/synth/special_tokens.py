"""Where the special tokens sit in a synthetic vocabulary.

Qwen tokenizers place one contiguous block of specials right after the byte-level BPE tokens; the
config's image/video/vision ids and the generation config's eos ids are offsets into that block.
Keeping the same order means the full preset gets the real ids (`<|endoftext|>` 248044,
`<|image_pad|>` 248056, ...). Ids between the block and `vocab_size` become reserved specials so the
tokenizer's length equals the embedding's rows exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashpack.errors import FlashpackError

QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
# Tool and thinking markers are plain text to the chat template: they must not be stripped on decode.
NOT_SKIPPED_ON_DECODE = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)
# A BPE over 256 bytes needs room for at least a few merges before the specials.
_MIN_REGULAR_TOKENS = 512


@dataclass(frozen=True)
class TokenIds:
    base: int  # first special id == number of regular BPE tokens
    vocab_size: int

    def id_of(self, token: str) -> int:
        return self.base + QWEN_SPECIALS.index(token)

    @property
    def endoftext(self) -> int:
        return self.id_of("<|endoftext|>")

    @property
    def im_end(self) -> int:
        return self.id_of("<|im_end|>")

    @property
    def reserved(self) -> list[str]:
        """Names of the reserved specials filling the ids after the Qwen block."""
        first = self.base + len(QWEN_SPECIALS)
        return [f"<|reserved_special_token_{i}|>" for i in range(self.vocab_size - first)]

    def all_specials(self) -> list[str]:
        return list(QWEN_SPECIALS) + self.reserved


def token_ids(vocab_size: int, special_base: int | None, default_tail: int) -> TokenIds:
    base = vocab_size - default_tail if special_base is None else special_base
    if base < _MIN_REGULAR_TOKENS or base + len(QWEN_SPECIALS) > vocab_size:
        raise FlashpackError(
            f"vocab_size {vocab_size} leaves no room for {_MIN_REGULAR_TOKENS} BPE tokens and "
            f"{len(QWEN_SPECIALS)} specials from id {base}"
        )
    return TokenIds(base=base, vocab_size=vocab_size)
