"""The pack's tokenizer and chat template, loaded with transformers (our tokenizer loader)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from flashpack.errors import FlashpackError
from flashpack.runtime.chat_encoding import ChatEncoder

# Unicode normalization composes at most three code points into one (Hangul L + V + T).
_NORMALIZATION_SHRINK = 3
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
MESSAGE_START = "<|im_start|>"  # the chat template's marker before each message's role


@dataclass
class PackTokenizer:
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    stop_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, pack: Path) -> "PackTokenizer":
        from transformers import AutoTokenizer

        directory = Path(pack) / "tokenizer"
        if not (directory / "tokenizer.json").is_file() and not (directory / "tokenizer_config.json").is_file():
            raise FlashpackError(f"pack {pack} has no tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(directory)
        return cls(tokenizer, _stop_ids(directory, tokenizer))

    def encode(self, text: str) -> list[int]:
        """`text` as the caller wrote it: marker text in it becomes the markers' tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        enable_thinking: bool | None = None,
    ) -> str:
        """The prompt text for `messages`, ending with the assistant turn's opening."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise FlashpackError("this pack's tokenizer has no chat template")
        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **extra
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        """The prompt ids for `messages`: the template's markers are control tokens, while marker text
        inside messages, tool calls, tool results or tool definitions is encoded as ordinary text
        (runtime/chat_encoding.py)."""
        return self.chat_encoder.encode(
            lambda wrapped, wrapped_tools: self.render_chat(wrapped, wrapped_tools, enable_thinking), messages, tools
        )

    def message_starts(self, prompt_ids: list[int]) -> list[int]:
        """Where each message of a chat prompt after the first begins: the positions of the
        template's message-start marker (`<|im_start|>`). Client text never encodes to a marker
        (runtime/chat_encoding.py), so these are the message boundaries a prompt cache saves at."""
        marker = self._message_start_id
        return [] if marker is None else [i for i, token in enumerate(prompt_ids) if token == marker and i > 0]

    @cached_property
    def _message_start_id(self) -> int | None:
        found = self.tokenizer.convert_tokens_to_ids(MESSAGE_START)
        return found if isinstance(found, int) and found != self.tokenizer.unk_token_id else None

    @cached_property
    def chat_encoder(self) -> ChatEncoder:
        return ChatEncoder(self.tokenizer)

    @cached_property
    def max_chars_per_token(self) -> int | None:
        """At most this many characters of text make one token, or None where no bound is known.

        Byte-level BPE covers every byte and a token spells at most its own length in bytes (each
        character of a byte-level token stands for one byte); a character is at least one byte, and
        the normalizers named above shrink text at most threefold. A tokenizer of another kind (an
        unknown token can stand for any amount of text) or normalizer gives no bound."""
        document = json.loads(self.tokenizer.backend_tokenizer.to_str())
        if (document.get("model") or {}).get("type") != "BPE" or (document.get("decoder") or {}).get("type") != "ByteLevel":
            return None
        shrink = _normalization_shrink(document.get("normalizer"))
        if shrink is None:
            return None
        vocabulary = self.tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
        return max(len(token) for token in vocabulary) * shrink


def _normalization_shrink(normalizer: dict[str, Any] | None) -> int | None:
    if normalizer is None:
        return 1
    parts = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    if all(part.get("type") in _COMPOSING_NORMALIZERS for part in parts):
        return _NORMALIZATION_SHRINK
    return None


def _stop_ids(directory: Path, tokenizer: Any) -> tuple[int, ...]:
    """End-of-turn ids: generation_config's eos_token_id(s), else the tokenizer's eos."""
    ids: list[int] = []
    config_path = directory / "generation_config.json"
    if config_path.is_file():
        eos = json.loads(config_path.read_text()).get("eos_token_id")
        ids = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return tuple(int(i) for i in ids)
