"""A decode step whose experts the store lands in several chunks (a slot share held by prefetches
still loading) runs every chunk at the step's full [T, k] shape, the picks a chunk lacks at zero
weight: the kernels keep their one build (a [n, 1] call would build again mid-decode) and the result
equals the one-chunk step's. A prompt streamed in chunks fills one buffer of (token, pick) rows,
chunk by chunk, and sums it once: equal to the one-call result. `_experts` and `moe_expert_pairs`
are replaced by stand-ins whose output depends on every slot and weight, so a lost, doubled or
misplaced pick shows. A decode step hands the store the next layer's guess to prefetch and the one
after's to read ahead, with its own request."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from flashpack.runtime.model import moe as moe_module
from flashpack.runtime.model.host_copy import PinnedStaging
from flashpack.runtime.model.moe import SparseMoE

K, H, E = 10, 8, 64


class ChunkedSlots:
    """What TieredStore.stream yields: handles (expert, slot), in chunks of the given sizes."""

    bank = None

    def __init__(self, sizes: list[int]):
        self.sizes = sizes

    def stream(self, layer, experts, prefetch_after=None, read_ahead=None):
        handles = [SimpleNamespace(expert=e, slot=3 * i + 1) for i, e in enumerate(experts)]
        start = 0
        for size in self.sizes:
            yield handles[start:start + size]
            start += size


def _step(sizes: list[int], calls: list) -> torch.Tensor:
    def experts_stand_in(x, bank, slots, weights, prompt):
        calls.append((tuple(slots.shape), prompt))
        return (weights * (slots + 1).to(weights.dtype)).sum(-1, keepdim=True) * x

    moe = SimpleNamespace(slots=ChunkedSlots(sizes), layer=1, num_experts=E, _experts=experts_stand_in,
                          staging=PinnedStaging())
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


def _expert_stand_in(x, slots, weights):
    """[T, K, H]: each pick's contribution, from its slot and weight."""
    return (weights * (slots + 1).to(weights.dtype))[..., None] * x[:, None, :]


def _prompt(sizes: list[int], monkeypatch, filled: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(the prompt's routed output from chunks of `sizes`, the one-call output of every slot)."""
    def pairs_stand_in(x, bank, slots, weights, pairs, bound):
        chosen = (slots >= 0).flatten()
        assert bound == (int(chosen.sum()), len(set(slots[slots >= 0].tolist())))
        pairs[chosen] = _expert_stand_in(x, slots, weights).flatten(0, 1)[chosen]
        filled.extend(torch.nonzero(chosen).flatten().tolist())

    monkeypatch.setattr(moe_module, "moe_expert_pairs", pairs_stand_in)
    generator = torch.Generator().manual_seed(1)
    tokens = 9
    x = torch.randn(tokens, H, generator=generator)
    experts = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(tokens)])
    weights = torch.rand(tokens, K, generator=generator)
    whole_slots = []
    moe = SimpleNamespace(slots=ChunkedSlots(sizes), layer=1, num_experts=E, staging=PinnedStaging(),
                          _experts=lambda x, bank, slots, weights, prompt: whole_slots.append(slots) or
                          _expert_stand_in(x, slots, weights).sum(1))
    moe._chunk_slots = lambda chunk, ids: SparseMoE._chunk_slots(moe, chunk, ids)
    counts = torch.bincount(experts.flatten(), minlength=E).tolist()
    out = SparseMoE._prompt_from_slots(moe, x, weights, experts, counts)
    wanted = sorted(set(experts.flatten().tolist()))
    slot_of = {expert: 3 * i + 1 for i, expert in enumerate(wanted)}  # as ChunkedSlots places them
    expected = _expert_stand_in(x, experts.apply_(lambda e: slot_of[e]), weights).sum(1)
    return out, expected


def test_prompt_streamed_in_chunks_fills_each_pair_once(monkeypatch):
    filled = []
    out, expected = _prompt([7, 9, 30, E], monkeypatch, filled)
    assert sorted(filled) == list(range(9 * K))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_prompt_held_whole_is_one_call(monkeypatch):
    filled = []
    out, expected = _prompt([E], monkeypatch, filled)
    assert filled == []
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_a_prompts_lost_chunk_shows(monkeypatch):
    """The control: a stream that drops its last chunks leaves pairs unfilled."""
    filled = []
    _prompt([7, 9], monkeypatch, filled)
    assert filled and sorted(filled) != list(range(9 * K))


class RecordingSlots(ChunkedSlots):
    """ChunkedSlots that records what each stream call was handed to look ahead at."""

    def __init__(self):
        super().__init__([K])
        self.calls, self.prefetches = [], []

    def stream(self, layer, experts, prefetch_after=None, read_ahead=None):
        self.calls.append((layer, experts, prefetch_after, read_ahead))
        yield from super().stream(layer, experts)

    def prefetch(self, layer, experts):
        self.prefetches.append((layer, experts))


def _looking_ahead(monkeypatch, during_loads: bool) -> RecordingSlots:
    monkeypatch.setattr(moe_module, "PREFETCH_DURING_LOADS", during_loads)
    slots = RecordingSlots()
    far_layer = SimpleNamespace(layer=7)
    moe = SimpleNamespace(slots=slots, layer=5, num_experts=E, staging=PinnedStaging(),
                          next_moe=SimpleNamespace(layer=6, next_moe=far_layer),
                          _experts=lambda x, bank, slots, weights, prompt: x)
    moe._decode_chunk = lambda *args, **kwargs: SparseMoE._decode_chunk(moe, *args, **kwargs)
    moe._routed_from_slots = lambda *args, **kwargs: SparseMoE._routed_from_slots(moe, *args, **kwargs)
    experts = torch.arange(K).flip(0).view(1, K)
    predicted = torch.arange(K, 2 * K).view(1, K)
    far = torch.tensor([[30, 31, 30] + list(range(40, 40 + K - 3))])  # repeats are read once
    SparseMoE.routed_from_store(moe, torch.ones(1, H), torch.ones(1, K), experts, predicted, far)
    return slots


def test_a_decode_step_hands_the_store_the_next_two_layers_guesses(monkeypatch):
    wanted, guessed = list(range(K)), list(range(K, 2 * K))
    farther = sorted({30, 31, *range(40, 40 + K - 3)})
    slots = _looking_ahead(monkeypatch, during_loads=True)
    assert slots.calls == [(5, wanted, (6, guessed), (7, farther))] and slots.prefetches == []
    # the prefetch once the loads landed (the control order) still reads ahead with the request
    slots = _looking_ahead(monkeypatch, during_loads=False)
    assert slots.calls == [(5, wanted, None, (7, farther))] and slots.prefetches == [(6, guessed)]


def test_the_far_guess_is_the_next_layers_prediction_only_with_read_ahead():
    guess = torch.tensor([[4, 2]])
    moe = SimpleNamespace(read_ahead=True, next_moe=SimpleNamespace(predict_next=lambda x: guess))
    assert SparseMoE.predict_far(moe, torch.ones(1, H)) is guess
    moe.read_ahead = False
    assert SparseMoE.predict_far(moe, torch.ones(1, H)) is None
    assert SparseMoE.predict_far(SimpleNamespace(read_ahead=True, next_moe=None), torch.ones(1, H)) is None
