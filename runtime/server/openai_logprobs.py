"""Log-probabilities in OpenAI's two shapes: the legacy completions object and chat's `content` list.

    completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob}, ...],
                  "text_offset": [...]}                       (one entry per token, in order)
    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
                  "refusal": None}

A token's text is its bytes as UTF-8; a token that holds part of a character is written
`bytes:\\xNN...`, as OpenAI writes it. A completions entry's `top_logprobs` holds the N most likely
tokens and the token itself (so up to N + 1 entries, as OpenAI's legacy API returns them); chat's
holds exactly N. The first token of an echoed prompt has no log-probability (null, as OpenAI and vLLM
return it). -inf, which JSON cannot carry, is written as -9999.0, as vLLM writes it.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flashpack.runtime.logprobs import TokenLogprob

FLOOR = -9999.0


def token_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


@dataclass
class CompletionLogprobs:
    """The legacy object built up token by token; `text_offset` counts characters of the choice's text
    (the echoed prompt included), `counts_text(token_id)` saying whether a token shows in that text
    (a generated special token does not; an echoed one does)."""

    token_bytes: Callable[[int], bytes]
    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    _decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))

    def add(self, token_id: int, scored: TokenLogprob | None, shows: bool = True) -> None:
        raw = self.token_bytes(token_id)
        self.tokens.append(token_text(raw))
        self.text_offset.append(self.offset)
        if shows:
            self.offset += len(self._decoder.decode(raw))
        if scored is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        self.token_logprobs.append(_value(scored.logprob))
        top: dict[str, float] = {}
        for alternative, logprob in (*scored.top, (scored.token_id, scored.logprob)):
            top.setdefault(token_text(self.token_bytes(alternative)), _value(logprob))
        self.top_logprobs.append(top)

    def add_prompt(self, prompt_ids: Sequence[int], scored: Sequence[TokenLogprob]) -> None:
        """The echoed prompt: its first token unscored, then each of the rest."""
        self.add(prompt_ids[0], None)
        for token_id, entry in zip(prompt_ids[1:], scored):
            self.add(token_id, entry)

    def take(self) -> dict[str, list]:
        """The entries added since the last take (a streamed chunk's), as the JSON object."""
        body = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return body


def chat_entry(scored: TokenLogprob, token_bytes: Callable[[int], bytes]) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(token_id)
        return {"token": token_text(raw), "logprob": _value(logprob), "bytes": list(raw)}

    return {**one(scored.token_id, scored.logprob), "top_logprobs": [one(t, lp) for t, lp in scored.top]}


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": entries, "refusal": None}
