"""Checked steps from graph pieces (runtime/engine/checked_graphs.py) against plain decoding.

A checked step of T tokens cut into one piece a layer (through a tiered store, a piece up to each
layer's router with its experts from the store between the pieces) must compute
for each row what one-token decode steps of those tokens compute from the decode graphs' pieces
(rel 1e-5 on a CPU in float32), and rewound to any of its tokens must leave the state that
decoding the kept tokens leaves. The reference is the decode pieces, not the eager layers: both
graph paths pick the indexer's top blocks over the whole fixed buffer, where the eager layers
break exact ties of its relu scores (common in the tiny model's two indexer heads) over the
visible blocks alone, as transformers does, so a tie may fall the other way. On a CPU the pieces run
as a replay would: from their second call on, what they write into tensors stands and what their
Python sets on the state (the tracked per-token states) does not, so the state must get those
from the pieces' outputs; a control that skips that must give other logits. On a GPU the same
with the pieces captured, and greedy speculative generation equal to plain decoding.
"""

from __future__ import annotations

import pytest
import torch

from flashpack.layout.pack import Pack
from flashpack.runtime.engine.build import engine_graphs, engine_model, load_engine
from flashpack.runtime.engine.checked_graphs import CheckedGraphs
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.speculative import SpeculativeDecoder
from flashpack.runtime.engine.step import Step
from flashpack.runtime.pack_source import PackWeights
from flashpack.runtime.sampling import SamplingParams
from flashpack.runtime.store.resident import ResidentExperts

TOLERANCE = 1e-5
TRACKED = ("positions", "window")


class ReplayLikeCall:
    """Stands in for a CapturedCall on a CPU: runs the piece every time, but from the second call
    on undoes what it set on the state's DeltaNet and PLE parts, as a replay runs none of it."""

    def __init__(self, fn, state_of):
        self.fn, self.state_of, self.calls = fn, state_of, 0

    def __call__(self, *inputs):
        self.calls += 1
        if self.calls == 1:
            return self.fn(*inputs)
        state = self.state_of()
        parts = [*state.deltanet.values(), *state.ple.values()]
        before = [(part, name, getattr(part, name)) for part in parts for name in TRACKED if hasattr(part, name)]
        out = self.fn(*inputs)
        for part, name, value in before:
            setattr(part, name, value)
        return out


class PlainCall:
    def __init__(self, fn, kept=()):
        self.fn = fn

    def __call__(self, *inputs):
        return self.fn(*inputs)


def _steps(tiny_pack, device: str = "cpu", compiled: bool = False, compile_mixers: bool = False):
    """(a step decoding from graph pieces, the same with checked pieces too), over one resident
    bank (compile_layers off on the GPU, as the checked pieces are)."""
    pack = Pack.open(tiny_pack)
    resident = ResidentExperts(pack, device, progress=False)
    config = EngineConfig(dtype="float32", compile_layers=False)
    steps = []
    for with_checked in (False, True):
        model = engine_model(PackWeights(pack), resident, config, torch.float32, torch.device(device))
        graphs = engine_graphs(model, config, make_call=None if device == "cuda" else PlainCall)
        checked = None
        if with_checked:
            checked = CheckedGraphs(model.layers, model.experts, compiled=compiled, compile_mixers=compile_mixers,
                                    make_call=None if device == "cuda" else (
                lambda fn, kept: ReplayLikeCall(fn, lambda: checked._state)))
        steps.append(Step(model, graphs, checked))
    return steps


def _tiered_steps(tiny_pack, device_slots: int, host_slots: int):
    """(plain, checked) as `_steps`, each over a tiered store of its own: `device_slots` device and
    `host_slots` host slots (the tiny model's 256 records; 40 leave most of a step's experts on disk)."""
    from flashpack.runtime.store import build_store
    from flashpack.runtime.store.budget import STAGING_ROW_SETS
    from flashpack.runtime.store.config import StoreConfig

    pack = Pack.open(tiny_pack)
    stride = pack.manifest.document["experts"]["record_stride"]
    config = EngineConfig(dtype="float32", compile_layers=False, read_ahead=False)
    steps, stores = [], []
    for with_checked in (False, True):
        rows = device_slots + STAGING_ROW_SETS * pack.manifest.config.num_experts_per_tok
        store = build_store(tiny_pack, StoreConfig(vram_budget=rows * stride, ram_budget=host_slots * stride),
                            device_reserved=0, staging=True)
        stores.append(store)
        model = engine_model(PackWeights(pack), store, config, torch.float32, torch.device("cpu"))
        checked = None
        if with_checked:
            checked = CheckedGraphs(model.layers, model.experts,
                                    make_call=lambda fn, kept: ReplayLikeCall(fn, lambda: checked._state))
        steps.append(Step(model, engine_graphs(model, config, make_call=PlainCall), checked))
    return steps, stores


def _tokens(index: int, count: int) -> torch.Tensor:
    return torch.randint(0, 1000, (count,), generator=torch.Generator().manual_seed(index))


def _checked_run(step: Step, prompt: torch.Tensor, steps: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The prompt, then tracked steps of (tokens, kept) rewound to their kept tokens, each followed
    by one plain step: every step's logits."""
    state = step.new_state()
    state.reserve(64)  # no attention cache grows within a run: the pieces stay bound, and replay
    logits = [step.forward(prompt, state, last_only=True).logits]
    for index, (count, kept) in enumerate(steps):
        tokens = _tokens(index, count)
        state.track()
        logits.append(step.forward(tokens, state).logits)
        state.rewind(kept)
        logits.append(step.forward(tokens[kept - 1:kept], state).logits)
    return logits


def _decoded_run(step: Step, prompt: torch.Tensor, steps: list[tuple[int, int]]) -> list[torch.Tensor]:
    """What `_checked_run` computes, by one-token steps: a checked step's rows are its tokens
    decoded one by one from a copy of the state; the state then decodes the kept ones."""
    state = step.new_state()
    state.reserve(64)
    logits = [step.forward(prompt, state, last_only=True).logits]
    for index, (count, kept) in enumerate(steps):
        tokens, trial = _tokens(index, count), step.new_state()
        trial.reserve(64)  # buffers of the same size: the indexer scores the same blocks
        trial.restore(state)
        logits.append(torch.cat([step.forward(token[None], trial).logits for token in tokens]))
        for token in tokens[:kept]:
            step.forward(token[None], state)
        logits.append(step.forward(tokens[kept - 1:kept], state).logits)
    return logits


# T = 2..5, each length again so the pieces "replay"; one
# step rewound to its first token, one kept whole
CHECKED_STEPS = [(3, 2), (5, 1), (3, 3), (2, 1), (5, 4), (2, 2), (4, 2), (4, 4), (5, 5), (3, 1)]


def _worst(got, expected) -> float:
    errors = torch.tensor([float((a - b).norm() / b.norm()) for a, b in zip(got, expected)])
    return float(errors.nan_to_num(nan=float("inf")).max())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below captures the pieces")
def test_checked_pieces_compute_plain_decoding_on_cpu(tiny_pack):
    plain, pieces = _steps(tiny_pack)
    prompt = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(2))  # past the indexer budget
    expected, got = _decoded_run(plain, prompt, CHECKED_STEPS), _checked_run(pieces, prompt, CHECKED_STEPS)
    assert len(got) == 1 + 2 * len(CHECKED_STEPS)
    assert _worst(got, expected) < TOLERANCE
    assert set(pieces.checked._pieces) == {2, 3, 4, 5}


def test_a_step_length_warms_up_over_its_first_two_runs(tiny_pack):
    """CheckedGraphs.warming: a length's first run compiles, its second captures, and a state with
    other buffers makes the pieces again; only then does a run replay. On a CPU the pieces run
    plainly and nothing ever warms up, so the counting is read as a GPU's graphs would read it."""
    _, pieces = _steps(tiny_pack)
    checked, state = pieces.checked, pieces.new_state()
    state.reserve(64)
    pieces.forward(torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(3)), state)

    def warming(tokens, on=state) -> bool:
        plain, checked.make_call = checked.make_call, None
        try:
            return checked.warming(tokens, on)
        finally:
            checked.make_call = plain

    assert not checked.warming(3, state) and warming(3)  # plain calls never warm up; graphs would
    seen = []
    for run in range(3):
        state.track()
        pieces.forward(_tokens(run, 3), state)
        state.rewind(3)
        seen.append(warming(3))
    assert seen == [True, False, False]  # after one run, after two, after three
    assert warming(4)  # a length not run yet
    other = pieces.new_state()
    other.reserve(64)
    assert warming(3, other)  # other buffers: the pieces are made again


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below captures the pieces")
def test_control_pieces_whose_tracked_states_are_not_handed_back_go_wrong(tiny_pack, monkeypatch):
    plain, pieces = _steps(tiny_pack)
    monkeypatch.setattr(CheckedGraphs, "_hand_back", staticmethod(lambda layer, state, tracked: None))
    prompt = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(2))
    expected, got = _decoded_run(plain, prompt, CHECKED_STEPS), _checked_run(pieces, prompt, CHECKED_STEPS)
    assert _worst(got, expected) > 1e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests capture the pieces")
@pytest.mark.parametrize("host_slots", [40, 300], ids=["disk-misses", "every-record-in-ram"])
def test_checked_pieces_through_a_tiered_store_compute_plain_decoding_on_cpu(tiny_pack, host_slots):
    """Through a tiered store each layer's piece stops at its router and the T rows' experts come
    through the store between the pieces (from disk where the tiers miss them): the same logits as
    one-token decode steps and the same rewinds; a control whose pieces keep the tracked states
    to themselves goes wrong here too."""
    (plain, pieces), stores = _tiered_steps(tiny_pack, 60, host_slots)
    assert pieces.checked.through_store
    store_experts, asked = pieces.checked.experts, []
    from_store = store_experts.from_store

    def recorded(layer, x, weights, experts, predicted, far=None, prompt=None):
        asked.append((layer, x.shape[0], predicted is not None, prompt))
        return from_store(layer, x, weights, experts, predicted, far, prompt=prompt)

    store_experts.from_store = recorded
    prompt = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(2))
    expected, got = _decoded_run(plain, prompt, CHECKED_STEPS), _checked_run(pieces, prompt, CHECKED_STEPS)
    assert _worst(got, expected) < TOLERANCE
    # the checked steps' experts by decode's kernels, each layer but the last naming the next one's
    last = pieces.model.config.num_hidden_layers - 1
    checked = [(layer, predicted) for layer, rows, predicted, prompt in asked if rows > 1 and prompt is False]
    assert len(checked) == pieces.model.config.num_hidden_layers * len(CHECKED_STEPS)
    assert all(predicted == (layer != last) for layer, predicted in checked)
    assert set(pieces.checked._pieces) == {2, 3, 4, 5}
    assert stores[1].stats.total().requests > 0
    for store in stores:
        store.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests capture the pieces")
def test_control_store_pieces_whose_tracked_states_are_not_handed_back_go_wrong(tiny_pack, monkeypatch):
    (plain, pieces), stores = _tiered_steps(tiny_pack, 60, 300)
    monkeypatch.setattr(CheckedGraphs, "_hand_back", staticmethod(lambda layer, state, tracked: None))
    prompt = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(2))
    assert _worst(_checked_run(pieces, prompt, CHECKED_STEPS), _decoded_run(plain, prompt, CHECKED_STEPS)) > 1e-3
    for store in stores:
        store.close()


def test_checked_pieces_refuse_what_they_do_not_take(tiny_pack):
    _, pieces = _steps(tiny_pack)
    state = pieces.new_state()
    with pytest.raises(ValueError, match="tracked state"):
        pieces.checked.run(torch.zeros(3, 1), torch.tensor([1, 2, 3]), state)  # not tracked
    assert not pieces.checked.takes(1) and not pieces.checked.takes(17) and pieces.checked.takes(16)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@needs_gpu
@pytest.mark.parametrize("compiled,compile_mixers", [(False, False), (True, False), (True, True)],
                         ids=["plain", "compiled", "compiled-mixers"])
def test_captured_checked_steps_compute_plain_decoding(tiny_pack, compiled, compile_mixers):
    plain, pieces = _steps(tiny_pack, "cuda", compiled, compile_mixers)
    prompt = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(2))
    expected, got = _decoded_run(plain, prompt, CHECKED_STEPS), _checked_run(pieces, prompt, CHECKED_STEPS)
    assert _worst(got, expected) < 1e-4  # T rows' projections by cuBLAS, one row's by the matvec kernel
    assert all(call.graph is not None for _, call in pieces.checked._pieces[3])


@needs_gpu
def test_control_captured_pieces_whose_tracked_states_are_not_handed_back_go_wrong(tiny_pack, monkeypatch):
    plain, pieces = _steps(tiny_pack, "cuda")
    monkeypatch.setattr(CheckedGraphs, "_hand_back", staticmethod(lambda layer, state, tracked: None))
    prompt = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(2))
    # a replay sets no tracked part: the rewind leaves DeltaNet and PLE after the whole step
    assert _worst(_checked_run(pieces, prompt, CHECKED_STEPS), _decoded_run(plain, prompt, CHECKED_STEPS)) > 1e-3


@needs_gpu
@pytest.mark.parametrize("draft_tokens,device_slots", [(2, None), (4, None), (4, 60)],
                         ids=["k2-resident", "k4-resident", "k4-tiered"])
def test_graphed_speculation_on_the_gpu_gives_the_plain_greedy_output(tiny_pack, draft_tokens, device_slots):
    """Plain steps and checked steps both from graphs, lookup drafts; every expert resident, or a
    device pool of 60 slots in front of the host cache (checked steps from store pieces, their
    experts through the store between the graphs)."""
    from flashpack.runtime.store.build import resident_device_bytes
    from flashpack.runtime.store.config import StoreConfig

    store = StoreConfig()
    if device_slots is not None:
        manifest = Pack.open(tiny_pack).manifest
        store = StoreConfig(vram_budget=resident_device_bytes(manifest, "float32", device="cuda")
                            + device_slots * manifest.document["experts"]["record_stride"])
    engine = load_engine(tiny_pack, EngineConfig(device="cuda", dtype="float32", prompt_cache_ram=0,
                                                 speculate="lookup", draft_tokens=draft_tokens, store=store))
    assert engine.step.checked is not None and engine.step.checked.through_store == (device_slots is not None)
    phrase = torch.randint(5, 1000, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=48)
    decoder: SpeculativeDecoder = engine.generator.speculation
    decoder.policy = False
    spoken = engine.generator.generate(phrase * 4, params).token_ids
    engine.generator.speculation = None
    assert spoken == engine.generator.generate(phrase * 4, params).token_ids
    captured = [call.graph is not None for calls in engine.step.checked._pieces.values() for _, call in calls]
    assert decoder.stats.steps > 0 and any(captured)
    engine.close()
