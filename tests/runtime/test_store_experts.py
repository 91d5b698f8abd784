"""A decode step whose experts the store lands in several chunks (a slot share held by prefetches
still loading) runs every chunk at the step's full [T, k] shape, the picks a chunk lacks at zero
weight: the kernels keep their one build (a [n, 1] call would build again mid-decode) and the result
equals the one-chunk step's. A prompt streamed in chunks fills one buffer of (token, pick) rows,
chunk by chunk, and sums it once: equal to the one-call result (runtime/engine/expert_paths.py's
StoreExperts). `fused_experts` and `moe_expert_pairs` are replaced by stand-ins whose output depends on every slot and weight, so a lost, doubled or
misplaced pick shows. A decode step hands the store the next layer's guess to prefetch and the one
after's to read ahead, with its own request."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from flashpack.runtime.engine import expert_paths
from flashpack.runtime.engine.expert_paths import Prediction, StoreExperts

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


def _step(sizes: list[int], calls: list, monkeypatch) -> torch.Tensor:
    def experts_stand_in(x, bank, slots, weights, prompt):
        calls.append((tuple(slots.shape), prompt))
        return (weights * (slots + 1).to(weights.dtype)).sum(-1, keepdim=True) * x

    monkeypatch.setattr(expert_paths, "fused_experts", experts_stand_in)
    store_experts = StoreExperts(ChunkedSlots(sizes), E, Prediction())
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, H, generator=generator)
    experts = torch.randperm(E, generator=generator)[:2 * K].view(2, K)
    weights = torch.rand(2, K, generator=generator)
    ids = experts.flatten().tolist()
    return store_experts._decode(1, x, weights, experts, sorted(set(ids)), ids)


def test_split_decode_step_keeps_its_shape_and_result(monkeypatch):
    whole_calls, split_calls = [], []
    whole = _step([2 * K], whole_calls, monkeypatch)
    split = _step([7, 9, 2 * K - 16], split_calls, monkeypatch)
    assert whole_calls == [((2, K), False)]
    assert split_calls == [((2, K), False)] * 3
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-6)


def test_a_lost_chunk_shows(monkeypatch):
    """The control: a stream that drops its last chunk's experts does not pass for the whole step."""
    whole = _step([2 * K], [], monkeypatch)
    partial = _step([7, 9], [], monkeypatch)
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

    monkeypatch.setattr(expert_paths, "moe_expert_pairs", pairs_stand_in)
    generator = torch.Generator().manual_seed(1)
    tokens = 9
    x = torch.randn(tokens, H, generator=generator)
    experts = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(tokens)])
    weights = torch.rand(tokens, K, generator=generator)
    whole_slots = []
    monkeypatch.setattr(expert_paths, "fused_experts", lambda x, bank, slots, weights, prompt: whole_slots.append(slots)
                        or _expert_stand_in(x, slots, weights).sum(1))
    counts = torch.bincount(experts.flatten(), minlength=E).tolist()
    out = StoreExperts(ChunkedSlots(sizes), E, Prediction())._prompt(1, x, weights, experts, counts)
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
    monkeypatch.setattr(expert_paths, "fused_experts", lambda x, bank, slots, weights, prompt: x)
    slots = RecordingSlots()
    store_experts = StoreExperts(slots, E, Prediction(prefetch_during_loads=during_loads))
    experts = torch.arange(K).flip(0).view(1, K)
    predicted = torch.arange(K, 2 * K).view(1, K)
    far = torch.tensor([[30, 31, 30] + list(range(40, 40 + K - 3))])  # repeats are read once
    store_experts.from_store(5, torch.ones(1, H), torch.ones(1, K), experts, predicted, far)
    return slots


def test_a_decode_step_hands_the_store_the_next_two_layers_guesses(monkeypatch):
    wanted, guessed = list(range(K)), list(range(K, 2 * K))
    farther = sorted({30, 31, *range(40, 40 + K - 3)})
    slots = _looking_ahead(monkeypatch, during_loads=True)
    assert slots.calls == [(5, wanted, (6, guessed), (7, farther))] and slots.prefetches == []
    # the prefetch once the loads landed (the control order) still reads ahead with the request
    slots = _looking_ahead(monkeypatch, during_loads=False)
    assert slots.calls == [(5, wanted, None, (7, farther))] and slots.prefetches == [(6, guessed)]


def test_predictions_come_from_the_next_layers_routers_and_the_far_one_only_with_read_ahead():
    guesses = {layer: torch.tensor([[layer, 2]]) for layer in range(4)}
    routers = {layer: (lambda x, layer=layer: (None, guesses[layer])) for layer in range(4)}
    x = torch.ones(1, H)
    reading = StoreExperts(ChunkedSlots([K]), E, Prediction(read_ahead=True))
    reading.predict_with(routers)
    assert reading.predict_next(1, x) is guesses[2] and reading.predict_far(1, x) is guesses[3]
    assert reading.predict_next(3, x) is None and reading.predict_far(2, x) is None  # no layer 4
    assert reading.predict_next(1, torch.ones(9, H)) is None  # a prompt: only with prompt_max_tokens
    short_prompts = StoreExperts(ChunkedSlots([K]), E, Prediction(prompt_max_tokens=9))
    short_prompts.predict_with(routers)
    assert short_prompts.predict_next(1, torch.ones(9, H)) is guesses[2]
    assert short_prompts.predict_next(1, torch.ones(10, H)) is None and short_prompts.predict_far(1, torch.ones(9, H)) is None
    not_reading = StoreExperts(ChunkedSlots([K]), E, Prediction(read_ahead=False))
    not_reading.predict_with(routers)
    assert not_reading.predict_next(1, x) is guesses[2] and not_reading.predict_far(1, x) is None
    no_prefetch = StoreExperts(ChunkedSlots([K]), E, Prediction(prefetch=False))
    no_prefetch.predict_with(routers)
    assert no_prefetch.predict_next(1, x) is None and no_prefetch.predict_far(1, x) is None


def test_a_short_prompt_prefetches_the_next_layers_guess_once_its_own_loads_are_queued(monkeypatch):
    """With a guess (Prediction.prompt_max_tokens), a prompt's layer streams its own experts as
    without one and then prefetches the next layer's guesses, the most picked first; its output is
    the same. Control: without a guess nothing is prefetched."""
    filled = []
    monkeypatch.setattr(expert_paths, "moe_expert_pairs", lambda *args: filled.append(1))
    monkeypatch.setattr(expert_paths, "fused_experts",
                        lambda x, bank, slots, weights, prompt: _expert_stand_in(x, slots, weights).sum(1))
    generator = torch.Generator().manual_seed(2)
    tokens = 9
    x = torch.randn(tokens, H, generator=generator)
    experts = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(tokens)])
    weights = torch.rand(tokens, K, generator=generator)
    predicted = torch.tensor([[50, 51]] * 3 + [[52, 51]] * 2 + [[53, 50]] * 4)  # 50 x7, 51 x5, 53 x4, 52 x2
    outputs = []
    for guess in (predicted, None):
        slots = RecordingSlots()
        slots.sizes = [E]  # the layer's share holds them all: one call
        outputs.append(StoreExperts(slots, E, Prediction(prompt_max_tokens=16)).from_store(
            5, x, weights, experts, guess))
        assert [call[2:] for call in slots.calls] == [(None, None)]  # the layer's own stream looks nowhere
        assert slots.calls[0][1] == sorted(set(experts.flatten().tolist()))
        assert slots.prefetches == ([(6, [50, 51, 53, 52])] if guess is not None else [])
    assert torch.equal(outputs[0], outputs[1]) and not filled
