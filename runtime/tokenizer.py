"""The pack's tokenizer and chat template, loaded with transformers (our tokenizer loader)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashpack.errors import FlashpackError


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
