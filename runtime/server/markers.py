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


def ids_open_thinking(prompt_ids: list[int], open_ids: list[int], close_ids: list[int]) -> bool:
    """True when the prompt leaves a <think> block open (the template started it). Read from the ids,
    not the text: marker text a client wrote is encoded as ordinary text (runtime/chat_encoding.py),
    so where the tags are single tokens only the template's own can match."""
    return _last_index(prompt_ids, open_ids) > _last_index(prompt_ids, close_ids)


def _last_index(ids: list[int], sequence: list[int]) -> int:
    """Where `sequence` last starts in `ids`; -1 if it does not occur."""
    width = len(sequence)
    if not width:
        return -1
    for start in range(len(ids) - width, -1, -1):
        if ids[start] == sequence[0] and ids[start:start + width] == sequence:
            return start
    return -1
