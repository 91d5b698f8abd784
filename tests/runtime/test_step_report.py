"""A decode step's report, counted by hand: what the store is told and what the run keeps; when a
step tries the slot table."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from flashpack.runtime.engine.step_report import Speculation, StagingCounts, count_step, report_row


def _layer(index: int):
    return SimpleNamespace(layer=index)


def test_a_report_row_and_its_count():
    experts, guess = torch.tensor([[5, 9]]), torch.tensor([[9, 4]])
    codes = torch.tensor([[3, -4]], dtype=torch.int32)  # 5 in device slot 3, 9 in host slot 2
    row = report_row(experts, codes, codes == -1, torch.tensor([[False, True]]), guess,
                     (guess, torch.tensor([[40, -1]])))  # 9 staged ahead into bank row 40, 4 not
    assert row.tolist() == [0, 1, 1, 5, 9, 3, -4, 0, 1]
    first = [0, 0, 0, 7, 8, 1, -2, 0, 0]  # layer 0: nothing predicted, 8 staged late
    counts = StagingCounts()
    found = count_step([_layer(0), _layer(1)], [first, row.tolist()], counts, predicts_next=[True, False])
    assert found == [(0, [7], [8], 0), (1, [5], [9], 0)]
    assert counts == StagingCounts(predicted=2, right=1, ahead=1, ahead_used=1, late=1)


def test_speculation_backs_off_after_failures_and_resets_on_success():
    speculation = Speculation()
    waits = []
    for _ in range(8):
        speculation.record(False)
        skipped = 0
        while not speculation.due():
            skipped += 1
        waits.append(skipped)
    assert waits == [2, 4, 8, 16, 32, 64, 64, 64]
    speculation.record(True)
    assert speculation.due() and speculation.tries == 9 and speculation.confirmed == 1
