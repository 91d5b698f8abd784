"""What a decode step from the store's slot table tells the host, and what the host keeps of it.

Each layer of such a step (decode_graphs.py) writes one row of an int32 report [layers, 3 + 3k]
on the device (`report_row`):

    [any expert only on disk, records staged ahead for it, its experts the layer before predicted,
     its k expert ids, their k slot-table codes (runtime/experts.py), which k came staged ahead]

The host reads the whole report back once, after the step: something on disk and the step is
redone through the store; else `count_step` turns it into what the store's `record_step` takes
and adds to the run's `StagingCounts`. `Speculation` decides when a step tries the table at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_SPECULATION_WAIT = 64  # steps


@dataclass
class StagingCounts:
    """Over the steps from the slot table that stood: the experts layers picked where the layer
    before had predicted them (`predicted`, `right`: picked as predicted), and how each expert
    found in the host cache reached its staging row: `ahead` (staged as the layer before predicted,
    beside the layer's work up to its router; `ahead_used` of them picked) or `late` (after its own
    router picked it)."""

    predicted: int = 0
    right: int = 0
    ahead: int = 0
    ahead_used: int = 0
    late: int = 0


@dataclass
class Speculation:
    """When a tiered step tries the device slot table first: always after a try that found every
    expert there; after n failed tries in a row, not for the next 2**n steps (at most 64)."""

    tries: int = 0
    confirmed: int = 0
    failures_in_a_row: int = 0
    skip: int = 0

    def due(self) -> bool:
        if self.skip:
            self.skip -= 1
            return False
        return True

    def record(self, confirmed: bool) -> None:
        self.tries += 1
        if confirmed:
            self.confirmed += 1
            self.failures_in_a_row = 0
        else:
            self.failures_in_a_row += 1
            self.skip = min(2 ** self.failures_in_a_row, MAX_SPECULATION_WAIT)


def report_row(experts, codes, missing, early, guess, ahead) -> torch.Tensor:
    """A layer's row: its experts [1, k] and their codes, which are on disk and which came staged
    ahead (each [1, k]), the layer before's prediction `guess` [1, k] or None, and `ahead`: (the
    predicted ids, their bank rows, -1 where not staged) or None."""
    zero = torch.zeros((), dtype=codes.dtype, device=codes.device)
    staged_ahead = (ahead[1] >= 0).sum().to(codes.dtype) if ahead is not None else zero
    right = (experts.unsqueeze(-1) == guess.unsqueeze(-2)).sum().to(codes.dtype) if guess is not None else zero
    return torch.cat([torch.stack([missing.any().to(codes.dtype), staged_ahead, right]),
                      experts.flatten().to(codes.dtype), codes.flatten(), early.flatten().to(codes.dtype)])


def count_step(layers, report: list[list[int]], counts: StagingCounts, predicts_next: list[bool]
               ) -> list[tuple[int, list[int], list[int], int]]:
    """A step that stood, its report read back: for the store's record_step, per layer (layer,
    experts found on the device, experts staged from the host cache, records staged ahead but not
    used); `counts` gains the step's predictions and stagings. `predicts_next[i]`: whether layer i
    predicted the next layer's experts."""
    found, guessed = [], False
    for layer, predicts, (_, ahead, right, *picks) in zip(layers, predicts_next, report):
        k = len(picks) // 3
        experts, codes, used_ahead = picks[:k], picks[k:2 * k], sum(picks[2 * k:])
        staged = [e for e, code in zip(experts, codes) if code < 0]
        found.append((layer.layer, [e for e, code in zip(experts, codes) if code >= 0], staged, ahead - used_ahead))
        if guessed:  # the layer before predicted this one's experts
            counts.predicted += k
            counts.right += right
        guessed = predicts
        counts.ahead += ahead
        counts.ahead_used += used_ahead
        counts.late += len(staged) - used_ahead
    return found
