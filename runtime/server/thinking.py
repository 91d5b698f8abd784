"""The thinking phase of a reply: its budget, and the hand-over to a grammar for the answer.

    before --<think>--> thinking --</think> (or forced at the budget)--> answer
       \\________________ any other token ________________________________/^

In `before`, `opening` says whether <think> is "forced" (thinking was asked for explicitly),
"allowed" or "never" (the template's default, with a grammar waiting: it goes first).

`ThinkingGate` is a TokenConstraint wrapped around an optional inner one (a JSON-schema or
tool-call grammar). While thinking, tokens are free except that the answer may not be skipped: if an
inner constraint waits, end-of-turn tokens are masked. Once `budget` thinking tokens have been
generated, the </think> tokens are forced one by one. The answer phase hands every call to the inner
constraint, which therefore only ever sees the answer.
"""

from __future__ import annotations

import torch

from flashpack.runtime.engine.generate import TokenConstraint


class ThinkingGate:
    def __init__(
        self,
        inner: TokenConstraint | None,
        open_ids: list[int],
        close_ids: list[int],
        budget: int | None,
        starts_open: bool,
        stop_ids: tuple[int, ...] = (),
        opening: str = "allowed",
    ):
        self.inner = inner
        self.open_ids, self.close_ids = open_ids, close_ids
        self.budget = budget
        self.stop_ids = list(stop_ids)
        self.opening = opening if len(open_ids) == 1 else "never"
        self.phase = "thinking" if starts_open else "before"
        self.thought = 0  # thinking tokens so far
        self.forced = 0  # </think> tokens forced so far
        self.recent: list[int] = []

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """float [vocab] -> float [vocab], disallowed entries -inf."""
        if self.phase == "thinking":
            if self.forced or (self.budget is not None and self.thought >= self.budget):
                return _only(logits, self.close_ids[self.forced])
            if self.inner is not None and self.stop_ids:
                logits = logits.clone()
                logits[self.stop_ids] = float("-inf")
            return logits
        if self.phase == "before" and self.opening == "forced":
            return _only(logits, self.open_ids[0])
        if self.inner is None:
            return logits
        if self.phase == "before" and self.opening == "allowed":
            opener = self.open_ids[0]
            allowed = self.inner.mask(logits.clone())
            allowed[opener] = logits[opener]
            return allowed
        return self.inner.mask(logits)

    def accept(self, token_id: int) -> None:
        if self.phase == "before":
            if self.opening != "never" and token_id == self.open_ids[0]:
                self.phase = "thinking"
                return
            self.phase = "answer"
        if self.phase == "thinking":
            self._accept_thinking(token_id)
        elif self.inner is not None:
            self.inner.accept(token_id)

    def is_terminated(self) -> bool:
        return self.phase == "answer" and self.inner is not None and self.inner.is_terminated()

    def _accept_thinking(self, token_id: int) -> None:
        if self.forced or (self.budget is not None and self.thought >= self.budget):
            self.forced += 1
            if self.forced == len(self.close_ids):
                self.phase = "answer"
            return
        self.thought += 1
        self.recent = (self.recent + [token_id])[-len(self.close_ids):]
        if self.recent == self.close_ids:
            self.phase = "answer"


def _only(logits: torch.Tensor, token: int) -> torch.Tensor:
    """Logits that allow `token` alone."""
    only = torch.full_like(logits, float("-inf"))
    only[token] = logits[token] if torch.isfinite(logits[token]) else 0.0
    return only
