"""A decode step whose experts the store lands in several chunks (a slot share held by prefetches
still loading) runs every chunk at the step's full [T, k] shape, the picks a chunk lacks at zero
weight: the kernels keep their one build (a [n, 1] call would build again mid-decode) and the result
equals the one-chunk step's. `_experts` is replaced by a stand-in whose output depends on every
slot and weight, so a lost, doubled or misplaced pick shows."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from flashpack.runtime.model.moe import SparseMoE

K, H, E = 10, 8, 64


class ChunkedSlots:
    """What TieredStore.stream yields: handles (expert, slot), in chunks of the given sizes."""

    bank = None

    def __init__(self, sizes: list[int]):
        self.sizes = sizes

    def stream(self, layer, experts):
        handles = [SimpleNamespace(expert=e, slot=3 * i + 1) for i, e in enumerate(experts)]
        start = 0
        for size in self.sizes:
            yield handles[start:start + size]
            start += size


def _step(sizes: list[int], calls: list) -> torch.Tensor:
    def experts_stand_in(x, bank, slots, weights, prompt):
        calls.append((tuple(slots.shape), prompt))
        return (weights * (slots + 1).to(weights.dtype)).sum(-1, keepdim=True) * x

    moe = SimpleNamespace(slots=ChunkedSlots(sizes), layer=1, num_experts=E, _experts=experts_stand_in)
    moe._decode_chunk = lambda *args, **kwargs: SparseMoE._decode_chunk(moe, *args, **kwargs)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, H, generator=generator)
    experts = torch.randperm(E, generator=generator)[:2 * K].view(2, K)
    weights = torch.rand(2, K, generator=generator)
    ids = experts.flatten().tolist()
    return SparseMoE._routed_from_slots(moe, x, weights, experts, sorted(set(ids)), ids)


def test_split_decode_step_keeps_its_shape_and_result():
    whole_calls, split_calls = [], []
    whole = _step([2 * K], whole_calls)
    split = _step([7, 9, 2 * K - 16], split_calls)
    assert whole_calls == [((2, K), False)]
    assert split_calls == [((2, K), False)] * 3
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-6)


def test_a_lost_chunk_shows():
    """The control: a stream that drops its last chunk's experts does not pass for the whole step."""
    whole = _step([2 * K], [])
    partial = _step([7, 9], [])
    assert (partial - whole).abs().max() > 1e-3
