"""How often prompt lookup's draft is what the model then decodes greedily.

For a prompt and the model's greedy continuation g_0..g_{G-1}: at every step t with k tokens
still to come (t <= G - k), prompt lookup (runtime/prompt_lookup.py, n from n_max down to 1)
drafts up to k tokens from the context prompt + g_<t, and the draft's accepted length is its
longest prefix equal to g_t..g_{t+k-1}, as a greedy speculative decoder would verify it.

    proposed                 share of steps with a draft at all
    accepted_at_least[j-1]   share of steps whose first j draft tokens were all accepted (j = 1..k)
    mean_accepted            accepted draft tokens per step (0..k); a verify step also yields one
                             token of its own, so it advances 1 + this
    speculative_tokens_per_step
                             the same continuation decoded speculatively: draft at t, accept m,
                             move to t + m + 1; G over the verify steps that took
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashpack.runtime.prompt_lookup import propose


@dataclass
class LookupMeter:
    n_max: int
    k: int
    steps: int = 0
    proposed: int = 0
    accepted: list[int] = field(default_factory=list)  # per step: tokens accepted
    generated: int = 0
    verify_steps: int = 0

    def add(self, prompt: list[int], continuation: list[int]) -> list[int]:
        """Score drafts along one greedy continuation; returns the accepted length at each step."""
        context = list(prompt) + list(continuation)
        base, length = len(prompt), len(continuation)
        accepted_here = []
        for t in range(length - self.k + 1):
            draft = propose(context[:base + t], self.n_max, self.k)
            self.proposed += bool(draft)
            accepted_here.append(_accepted(draft, continuation[t:t + self.k]))
        self.steps += len(accepted_here)
        self.accepted += accepted_here
        self.generated += length
        self.verify_steps += _speculative_steps(context, base, self.n_max, self.k)
        return accepted_here

    def result(self) -> dict:
        steps = max(self.steps, 1)
        at_least = [sum(a >= j for a in self.accepted) / steps for j in range(1, self.k + 1)]
        return {
            "steps": self.steps, "proposed": self.proposed / steps, "accepted_at_least": at_least,
            "mean_accepted": sum(self.accepted) / steps,
            "mean_accepted_when_proposed": sum(self.accepted) / self.proposed if self.proposed else 0.0,
            "speculative_tokens_per_step": self.generated / self.verify_steps if self.verify_steps else 0.0,
        }


def _accepted(draft: list[int], truth: list[int]) -> int:
    accepted = 0
    for drafted, actual in zip(draft, truth):
        if drafted != actual:
            break
        accepted += 1
    return accepted


def _speculative_steps(context: list[int], base: int, n_max: int, k: int) -> int:
    """Verify steps a greedy speculative decoder with prompt lookup needs for context[base:]."""
    position, steps = base, 0
    while position < len(context):
        draft = propose(context[:position], n_max, k)
        accepted = _accepted(draft, context[position:position + k])
        position += min(accepted + 1, len(context) - position)
        steps += 1
    return steps
