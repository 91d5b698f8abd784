"""The Qwen-style tags that structure a reply: <think>...</think> and <tool_call>{json}</tool_call>.

A tag is usually one added token of the vocabulary; grammars must then name that token (by id)
rather than spell the text, and the thinking gate forces it by id. `ids` gives the token sequence
either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Markers:
    tokenizer: Any  # a transformers tokenizer
    _single: dict[str, int | None] = field(default_factory=dict)

    def single_id(self, tag: str) -> int | None:
        """The id of the one token that is exactly `tag`, or None if the tag spans several tokens."""
        if tag not in self._single:
            vocab = self.tokenizer.get_vocab()
            self._single[tag] = vocab.get(tag)
        return self._single[tag]

    def ids(self, tag: str) -> list[int]:
        single = self.single_id(tag)
        return [single] if single is not None else self.tokenizer.encode(tag, add_special_tokens=False)

    def lark(self, tag: str) -> str:
        """The tag as a Lark (llguidance) terminal: the token by id when it is one token."""
        single = self.single_id(tag)
        return f"<[{single}]>" if single is not None else '"' + tag.replace("\\", "\\\\").replace('"', '\\"') + '"'


def prompt_opens_thinking(prompt: str) -> bool:
    """True when the rendered prompt leaves a <think> block open (the template started it)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)
