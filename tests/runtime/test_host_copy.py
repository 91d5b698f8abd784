"""PinnedStaging: small host tensors reach the GPU exactly, through a ring of reused pinned buffers.
Each staged tensor is overwritten on the host right after it was handed over, and the ring is two
deep while twenty tensors of growing sizes and several dtypes pass through it, so a buffer reused
before its copy ran, or a result that aliases the host tensor, shows up as wrong values."""

from __future__ import annotations

import pytest
import torch

from flashpack.runtime.model.host_copy import PinnedStaging


def test_on_the_host_it_is_a_plain_copy():
    tensor = torch.arange(6, dtype=torch.int32).view(2, 3)
    out = PinnedStaging().to_device(tensor, "cpu")
    assert torch.equal(out, tensor)


class _NoWait(torch.cuda.Event):
    """The control: an event whose synchronize() returns at once, as if the ring did not wait."""

    def synchronize(self) -> None:
        pass


def _arrived_intact(staging: PinnedStaging) -> bool:
    generator = torch.Generator().manual_seed(0)
    torch.cuda._sleep(50_000_000)  # the copies queue behind a busy stream: reuse must wait for them
    sent, arrived = [], []
    for step in range(20):
        dtype = (torch.int32, torch.bfloat16, torch.float32)[step % 3]
        tensor = torch.randn(1 + step * 300, generator=generator).mul(100).to(dtype)
        sent.append(tensor.clone())
        arrived.append(staging.to_device(tensor, "cuda"))
        tensor.fill_(0)  # the caller reuses its host tensor at once
    torch.cuda.synchronize()
    return all(got.device.type == "cuda" and torch.equal(got.cpu(), expected) for expected, got in zip(sent, arrived))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a GPU")
def test_every_tensor_arrives_as_it_was_handed_over_though_the_ring_reuses_its_buffers(monkeypatch):
    assert _arrived_intact(PinnedStaging(depth=2))
    monkeypatch.setattr(torch.cuda, "Event", _NoWait)  # reusing a buffer before its copy ran must show
    assert not _arrived_intact(PinnedStaging(depth=2))
