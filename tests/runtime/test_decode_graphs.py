"""CUDA-graph decode against eager decode on the same engine weights.

On a GPU, in float32, at every step, with every expert resident and with a tiered store (a step
from the store's slot table, and redone through the store when an expert was missing), also
after a snapshot is restored (restored in place: the graphs stay bound) and for a second sequence
(they are captured again): logits must agree to rel 1e-5 with the layers' pieces replayed as they
are (graph QSA attends over its whole buffer under a mask, eager over the picked keys: a different
summation order), and to rel 1e-4 with the pieces compiled (Inductor fuses and reorders the
reductions) or a tiered store (atomic adds in its prompts' expert sums); the expert source must
count the same requests either way. On a CPU: the same cut
into pieces, each run plainly, must compute what the layers compute (rel 1e-6).
"""

from __future__ import annotations

import time

import pytest
import torch

from flashpack.runtime.bench.clock import LayerClock
from flashpack.runtime.engine.build import engine_graphs, engine_model, load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.step import Step
from flashpack.runtime.store.config import StoreConfig

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
TOLERANCE = 1e-6


def _decode(engine, prompt: torch.Tensor, steps: int, restore_at: int | None = None) -> list[torch.Tensor]:
    """Greedy logits of an Engine's (or a Step's) prompt and `steps` decode steps."""
    step = getattr(engine, "step", engine)
    state = step.new_state()
    logits = [step.forward(prompt, state, last_only=True).logits]
    saved = None
    for index in range(steps):
        if index == restore_at:
            saved = state.snapshot()
        token = int(logits[-1].argmax())
        logits.append(step.forward(torch.tensor([token]), state).logits)
    if saved is not None:
        state.restore(saved)
        for _ in range(3):
            logits.append(step.forward(torch.tensor([int(logits[-1].argmax())]), state).logits)
    return logits


def _worst(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """The largest relative error over the steps; NaN (garbage in a row read) counts as infinite,
    where max() over floats would pass it by."""
    errors = torch.tensor([float((a - b).norm() / b.norm()) for a, b in zip(got, expected)])
    return float(errors.nan_to_num(nan=float("inf")).max())


def _store_config(tiny_pack, device_slots: int | None) -> StoreConfig:
    """Every record resident, or a device pool of `device_slots` slots in front of the host cache."""
    if device_slots is None:
        return StoreConfig()
    from flashpack.layout.pack import Pack
    from flashpack.runtime.store.build import resident_device_bytes

    manifest = Pack.open(tiny_pack).manifest
    reserved = resident_device_bytes(manifest, "float32", device="cuda")
    return StoreConfig(vram_budget=reserved + device_slots * manifest.document["experts"]["record_stride"])


def _gpu_engine(tiny_pack, device_slots: int | None, **settings):
    """The tiny pack on the GPU in float32 through a store of `device_slots` (None: resident)."""
    return load_engine(tiny_pack, EngineConfig(device="cuda", dtype="float32", store=_store_config(tiny_pack, device_slots),
                                               **settings))


@needs_gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
@pytest.mark.parametrize("tiered", [None, 60, 250], ids=["resident", "tiered-60", "tiered-250"])
def test_graph_decode_matches_eager(tiny_pack, tiered, compiled):
    prompt = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(0))
    eager = _gpu_engine(tiny_pack, tiered, cuda_graphs=False)
    graphed = _gpu_engine(tiny_pack, tiered, compile_layers=compiled)
    assert graphed.step.graphs is not None and eager.step.graphs is None
    # a tiered prompt's chunks fill their (token, pick) rows of one buffer, summed over the picks
    # once as the resident path sums, so chunking does not change the sum; the tiered tolerance is
    # the compiled one
    tolerance = 1e-4 if compiled or tiered is not None else 1e-5
    for _ in range(2):  # a second sequence: new state buffers, graphs captured again
        # 40 steps: past the indexer's budget, and the attention caches grow (graphs captured again)
        expected, got = _decode(eager, prompt, 40, restore_at=30), _decode(graphed, prompt, 40, restore_at=30)
        assert _worst(got, expected) < tolerance, [float((a - b).norm() / b.norm()) for a, b in zip(got, expected)]
    graphed.step.settle()
    assert graphed.store.stats.total().requests == eager.store.stats.total().requests
    if tiered is not None:  # the host cache holds every record read: steps from the slot table stand
        assert graphed.step.graphs.speculation.confirmed > 0
    if tiered == 60:  # most records in RAM: some staged beside the layer before, on the side stream
        assert graphed.step.graphs.staging.ahead_used > 0


@needs_gpu
@pytest.mark.parametrize("tiered", [None, 60], ids=["resident", "tiered-60"])
def test_graphs_of_two_layers_match_eager(tiny_pack, tiered):
    """A step cut into graphs of two layers each hands the prediction across each graph's end."""
    prompt = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(3))
    eager = _gpu_engine(tiny_pack, tiered, cuda_graphs=False)
    graphed = _gpu_engine(tiny_pack, tiered, compile_layers=False, layers_per_graph=2)
    assert graphed.step.graphs.layers_per_graph == 2
    expected, got = _decode(eager, prompt, 12), _decode(graphed, prompt, 12)
    assert _worst(got, expected) < (1e-4 if tiered else 1e-5)


@needs_gpu
@pytest.mark.parametrize("tiered", [None, 60], ids=["resident", "tiered-60"])
def test_fused_hyper_connection_mixes_match_eager(tiny_pack, tiered):
    """Decode steps whose hyper-connection mixes run as runtime/kernels/hc_mix.py's kernels, in
    compiled graphs, compute what the plain eager engine does (float32: summation order only)."""
    prompt = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(4))
    eager = _gpu_engine(tiny_pack, tiered, cuda_graphs=False, fused_mix=False)
    fused = _gpu_engine(tiny_pack, tiered)  # fused: the default on a GPU
    assert all(layer.attn_hc.fused and layer.mlp_hc.fused for layer in fused.model.layers)
    expected, got = _decode(eager, prompt, 12), _decode(fused, prompt, 12)
    assert _worst(got, expected) < 1e-4


def test_fused_mixes_need_cuda(tiny_pack):
    """The fused mixes are Triton kernels compiled for a GPU: a CPU engine runs the module's code
    whatever `fused_mix` says, and refuses them when asked directly."""
    from flashpack.layout.pack import Pack
    from flashpack.runtime.model import Qwen4ExpModel
    from flashpack.runtime.pack_source import PackExperts, PackWeights

    engine = load_engine(tiny_pack, EngineConfig(fused_mix=True))
    assert not any(layer.attn_hc.fused for layer in engine.model.layers)
    pack = Pack.open(tiny_pack)
    with pytest.raises(ValueError, match="CUDA only"):
        Qwen4ExpModel(PackWeights(pack), PackExperts(pack), dtype=torch.float32, fused_mix=True)


@needs_gpu
def test_graph_control_a_changed_weight_shows(tiny_pack):
    """Replays must read live weights: scaling one layer's router after capture changes the logits."""
    prompt = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(1))
    graphed = _gpu_engine(tiny_pack, None, compile_layers=False)
    before = _decode(graphed, prompt, 4)
    graphed.model.layers[0].moe.shared_down_proj.weight.mul_(3.0)
    after = _decode(graphed, prompt, 4)
    assert float((after[-1] - before[-1]).norm() / before[-1].norm()) > 1e-3


class PlainCall:
    """Stands in for CapturedCall on a CPU: runs the piece every time."""

    graph = None

    def __init__(self, fn, kept=()):
        self.fn = fn

    def __call__(self, *inputs):
        return self.fn(*inputs)


def _tiered_pair(tiny_pack, device_slots: int, host_slots: int = 300, staging: bool = True, layers_per_graph: int = 1,
                 staged_beside_experts: int = 1):
    """Two steps over two stores of `device_slots` and `host_slots` slots: the plain layers, and
    the graph pieces (each layer predicting the next one's experts, no read-ahead)."""
    from flashpack.layout.pack import Pack
    from flashpack.runtime.pack_source import PackWeights
    from flashpack.runtime.store import build_store
    from flashpack.runtime.store.budget import STAGING_ROW_SETS
    from flashpack.runtime.store.config import StoreConfig

    pack = Pack.open(tiny_pack)
    stride = pack.manifest.document["experts"]["record_stride"]
    config = EngineConfig(dtype="float32", read_ahead=False, layers_per_graph=layers_per_graph,
                          staged_beside_experts=staged_beside_experts)
    stores, models = [], []
    for _ in range(2):
        rows = device_slots + (STAGING_ROW_SETS * pack.manifest.config.num_experts_per_tok if staging else 0)
        store = build_store(tiny_pack, StoreConfig(vram_budget=rows * stride, ram_budget=host_slots * stride),
                            device_reserved=0, staging=staging)
        stores.append(store)
        models.append(engine_model(PackWeights(pack), store, config, torch.float32, torch.device("cpu")))
    return stores, [Step(models[0]), Step(models[1], engine_graphs(models[1], config, make_call=PlainCall))]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test above covers the captured pieces")
@pytest.mark.parametrize("device_slots, host_slots, staging, layers_per_graph, beside_experts", [
    (60, 40, True, 1, 1), (60, 300, True, 1, 1), (60, 300, True, 1, 0), (60, 300, True, 1, 10),
    (60, 300, True, 2, 1), (300, 300, True, 1, 1), (60, 300, False, 1, 1),
], ids=["disk-misses-redone", "host-records-staged", "none-beside-experts", "all-beside-experts",
        "two-layers-a-graph", "all-on-device", "no-staging-rows"])
def test_tiered_pieces_compose_to_the_layers_on_cpu(tiny_pack, monkeypatch, device_slots, host_slots, staging,
                                                    layers_per_graph, beside_experts):
    """With a tiered store a step first runs against the store's slot table, staging the experts
    it finds in the host cache into device rows itself; a step that found an expert only on disk
    is redone from the saved state with the routed experts eager between the pieces (ids to the
    host, the store, the kernels, the prefetch). Either way: the layers' logits and the same expert
    requests. The tiny model routes uniformly over 256 records: 40 host slots leave most steps a
    disk miss, 300 hold every record, so each way is taken; without staging rows a host record is
    a miss like a disk one. A step is a chain of graphs of one layer each, or of two (the
    prediction handed across a graph's end either way); a graph's last layer stages none, some or
    all of the next graph's predicted records beside its experts."""
    stores, steps = _tiered_pair(tiny_pack, device_slots, host_slots, staging, layers_per_graph, beside_experts)
    prompt = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(5))
    expected, got = _decode(steps[0], prompt, 24), _decode(steps[1], prompt, 24)
    for index, (a, b) in enumerate(zip(got, expected)):
        assert float((a - b).norm() / b.norm()) < TOLERANCE, f"step {index}"
    # the same requests; which of them hit depends on when the reader threads land the prefetches.
    # A step from the slot table is counted once the next step is under way, or at settle()
    steps[1].settle()
    plain, pieces = (store.stats.total() for store in stores)
    assert pieces.requests == plain.requests and pieces.prefetch_issued > 0
    steps[1].settle()  # nothing left to count twice
    assert stores[1].stats.total().requests == plain.requests
    speculation = steps[1].graphs.speculation
    if host_slots == 40 or not staging:
        assert speculation.tries > speculation.confirmed
    else:
        assert speculation.confirmed > 0
    if (device_slots, host_slots, staging) == (60, 300, True):  # steps that stood staged host records
        assert pieces.host_hits > plain.host_hits
        counts = steps[1].graphs.staging  # some as predicted, while the layer before ran
        assert counts.ahead_used > 0 and counts.late > 0 and 0 < counts.right <= counts.predicted
    for store in stores:
        store.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test above covers the captured pieces")
@pytest.mark.parametrize("broken", ["misses-ignored", "state-not-restored", "ahead-not-staged", "rest-not-staged",
                                    "ahead-rows-shared"])
def test_control_a_tiered_step_must_see_its_misses_and_restore_its_state(tiny_pack, monkeypatch, broken):
    """Controls: a step that took a missing expert as found, that was redone without restoring the
    state it had advanced, whose predicted experts' rows were named but never staged (none of them,
    or those the graph before left to the next), or (graphs of two layers) whose next layer's
    records were staged into the rows this layer's experts still read, must give other logits."""
    from flashpack.runtime.engine import decode_graphs, graph_pieces

    if broken == "misses-ignored":
        found = graph_pieces.table_slots
        monkeypatch.setattr(graph_pieces, "table_slots", lambda experts, weights, *args: (
            lambda slots, _, codes, missing, early: (slots, weights, codes, torch.zeros_like(missing), early))(
                *found(experts, weights, *args)))
    if broken in ("ahead-not-staged", "rest-not-staged"):
        ahead = graph_pieces.ahead_offsets
        monkeypatch.setattr(graph_pieces, "ahead_offsets", lambda *args: (
            lambda now, later, rows: (now if broken == "rest-not-staged" else torch.full_like(now, -1),
                                      torch.full_like(later, -1), rows))(*ahead(*args)))
    if broken == "ahead-rows-shared":
        monkeypatch.setattr(decode_graphs, "ahead_rows", lambda layer: 1)
    # 40 host slots: most steps meet a disk miss; 300: every step stands, staging host records
    stores, steps = _tiered_pair(tiny_pack, 60, host_slots=40 if broken in ("misses-ignored", "state-not-restored")
                                 else 300, layers_per_graph=2 if broken == "ahead-rows-shared" else 1)
    if broken == "state-not-restored":
        bind = steps[1].graphs._bind
        monkeypatch.setattr(steps[1].graphs, "_bind", lambda *args: (bind(*args), steps[1].graphs._saved.clear()))
    prompt = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(5))
    expected, got = _decode(steps[0], prompt, 24), _decode(steps[1], prompt, 24)
    assert _worst(got, expected) > 1e-3
    for store in stores:
        store.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test above covers the captured pieces")
def test_pieces_compose_to_the_layers_on_cpu(tiny_pack):
    """How decode is cut into graph pieces (every layer in one piece: QSA attending over its
    whole buffer under a mask) must compute what the layers do, past the indexer's budget."""
    from flashpack.layout.pack import Pack
    from flashpack.runtime.pack_source import PackWeights
    from flashpack.runtime.store.resident import ResidentExperts

    pack = Pack.open(tiny_pack)
    resident = ResidentExperts(pack, "cpu", progress=False)
    config = EngineConfig(dtype="float32")
    plain = Step(engine_model(PackWeights(pack), resident, config, torch.float32, torch.device("cpu")))
    model = engine_model(PackWeights(pack), resident, config, torch.float32, torch.device("cpu"))
    pieces = Step(model, engine_graphs(model, config, make_call=PlainCall))
    clock = pieces.graphs.layer_clock = LayerClock(torch.device("cpu"))  # the bench's per-layer time
    prompt = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(2))
    expected = _decode(plain, prompt, 24)
    start = time.perf_counter()
    got = _decode(pieces, prompt, 24)  # past the indexer budget
    each = clock.take()
    assert set(each) == {layer.layer for layer in model.layers}  # a graph a layer: each layer timed
    assert all(seconds > 0 for seconds in each.values()) and sum(each.values()) < time.perf_counter() - start
    for index, (a, b) in enumerate(zip(got, expected)):
        assert float((a - b).norm() / b.norm()) < TOLERANCE, f"step {index}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test above covers the captured pieces")
def test_a_failing_step_releases_the_slot_table(tiny_pack, monkeypatch):
    """An error inside a step from the slot table must not leave the table held: the store's copy
    and read jobs wait while it is, and would wait for ever."""
    def broken(*args):
        raise RuntimeError("kernel failed")

    stores, steps = _tiered_pair(tiny_pack, 60)
    monkeypatch.setattr(steps[1].graphs, "table_slots", broken)
    state = steps[1].new_state()
    logits = steps[1].forward(torch.randint(0, 1000, (8,)), state, last_only=True).logits
    with pytest.raises(RuntimeError, match="kernel failed"):
        steps[1].forward(torch.tensor([int(logits.argmax())]), state)
    assert steps[1].graphs.speculation.tries == 0 and not stores[1].placement.table_held
    for store in stores:
        store.close()
