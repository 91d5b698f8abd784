"""CUDA-graph decode against eager decode on the same engine weights.

On a GPU, in float32, at every step, with every expert resident and with a tiered store, also
after a snapshot is restored (restored in place: the graphs stay bound) and for a second sequence
(they are captured again): logits must agree to rel 1e-5 with the layers' pieces replayed as they
are (graph QSA attends over its whole buffer under a mask, eager over the picked keys: a different
summation order), and to rel 1e-4 with the pieces compiled (Inductor fuses and reorders the
reductions); the expert source must count the same requests either way. On a CPU: the same cut
into pieces, each run plainly, must compute what the layers compute (rel 1e-6).
"""

from __future__ import annotations

import pytest
import torch

from flashpack.runtime.loader import StoreOptions, load_engine

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
TOLERANCE = 1e-6


def _decode(engine, prompt: torch.Tensor, steps: int, restore_at: int | None = None) -> list[torch.Tensor]:
    model = getattr(engine, "model", engine)
    state = model.new_state()
    logits = [model(prompt, state, last_only=True).logits]
    saved = None
    for step in range(steps):
        if step == restore_at:
            saved = state.snapshot()
        token = int(logits[-1].argmax())
        logits.append(model(torch.tensor([token]), state).logits)
    if saved is not None:
        state.restore(saved)
        for _ in range(3):
            logits.append(model(torch.tensor([int(logits[-1].argmax())]), state).logits)
    return logits


def _store_options(tiny_pack, tiered: bool) -> StoreOptions:
    """Every record resident, or a device pool of 60 slots in front of the host cache."""
    if not tiered:
        return StoreOptions()
    from flashpack.layout.pack import Pack
    from flashpack.runtime.store.build import resident_device_bytes

    manifest = Pack.open(tiny_pack).manifest
    reserved = resident_device_bytes(manifest, "float32", device="cuda")
    return StoreOptions(vram_budget=str(reserved + 60 * manifest.document["experts"]["record_stride"]))


@needs_gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
@pytest.mark.parametrize("tiered", [False, True], ids=["resident", "tiered"])
def test_graph_decode_matches_eager(tiny_pack, tiered, compiled):
    prompt = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(0))
    options = _store_options(tiny_pack, tiered)
    eager = load_engine(tiny_pack, "cuda", dtype="float32", store=options, cuda_graphs=False)
    graphed = load_engine(tiny_pack, "cuda", dtype="float32", store=options, compile_layers=compiled)
    assert graphed.model.decode_graphs is not None and eager.model.decode_graphs is None
    tolerance = 1e-4 if compiled else 1e-5
    for _ in range(2):  # a second sequence: new state buffers, graphs captured again
        # 40 steps: past the indexer's budget, and the attention caches grow (graphs captured again)
        expected, got = _decode(eager, prompt, 40, restore_at=30), _decode(graphed, prompt, 40, restore_at=30)
        errors = [float((a - b).norm() / b.norm()) for a, b in zip(got, expected)]
        assert max(errors) < tolerance, f"worst step {errors.index(max(errors))}: {errors}"
    assert graphed.store.stats.total().requests == eager.store.stats.total().requests


@needs_gpu
def test_graph_control_a_changed_weight_shows(tiny_pack):
    """Replays must read live weights: scaling one layer's router after capture changes the logits."""
    prompt = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(1))
    graphed = load_engine(tiny_pack, "cuda", dtype="float32", store=StoreOptions(), compile_layers=False)
    before = _decode(graphed, prompt, 4)
    graphed.model.layers[0].moe.shared_down_proj.weight.mul_(3.0)
    after = _decode(graphed, prompt, 4)
    assert float((after[-1] - before[-1]).norm() / before[-1].norm()) > 1e-3


class PlainCall:
    """Stands in for CapturedCall on a CPU: runs the piece every time."""

    graph = None

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *inputs):
        return self.fn(*inputs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test above covers the captured pieces")
def test_tiered_pieces_compose_to_the_layers_on_cpu(tiny_pack):
    """With a tiered store the routed experts run eagerly between the graphs (ids to the host, the
    store, the kernels, the prefetch): same logits and the same expert requests as the layers."""
    from flashpack.layout.pack import Pack
    from flashpack.runtime.model import Qwen4ExpModel
    from flashpack.runtime.model.decode_graphs import DecodeGraphs
    from flashpack.runtime.pack_source import PackWeights
    from flashpack.runtime.store import build_store

    pack = Pack.open(tiny_pack)
    stride = pack.manifest.document["experts"]["record_stride"]
    stores, models = [], []
    for _ in range(2):
        store = build_store(tiny_pack, 60 * stride, 200 * stride, device_reserved=0)
        model = Qwen4ExpModel(PackWeights(pack), store, dtype=torch.float32)
        model.prefetch_next_layer()
        stores.append(store)
        models.append(model)
    models[1].decode_graphs = DecodeGraphs(models[1].layers, make_call=PlainCall)
    prompt = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(5))
    expected, got = _decode(models[0], prompt, 12), _decode(models[1], prompt, 12)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert float((a - b).norm() / b.norm()) < TOLERANCE, f"step {step}"
    # the same requests; which of them hit depends on when the reader threads land the prefetches
    plain, pieces = (store.stats.total() for store in stores)
    assert pieces.requests == plain.requests and pieces.prefetch_issued > 0
    for store in stores:
        store.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test above covers the captured pieces")
def test_pieces_compose_to_the_layers_on_cpu(tiny_pack):
    """How decode is cut into graph pieces (every layer in one piece: QSA attending over its
    whole buffer under a mask) must compute what the layers do, past the indexer's budget."""
    from flashpack.layout.pack import Pack
    from flashpack.runtime.model import Qwen4ExpModel
    from flashpack.runtime.model.decode_graphs import DecodeGraphs
    from flashpack.runtime.pack_source import PackWeights
    from flashpack.runtime.store.resident import ResidentExperts

    pack = Pack.open(tiny_pack)
    resident = ResidentExperts(pack, "cpu", progress=False)
    plain = Qwen4ExpModel(PackWeights(pack), resident, dtype=torch.float32)
    pieces = Qwen4ExpModel(PackWeights(pack), resident, dtype=torch.float32)
    pieces.decode_graphs = DecodeGraphs(pieces.layers, resident.count_replay, make_call=PlainCall)
    prompt = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(2))
    expected, got = _decode(plain, prompt, 24), _decode(pieces, prompt, 24)  # past the indexer budget
    for step, (a, b) in enumerate(zip(got, expected)):
        assert float((a - b).norm() / b.norm()) < TOLERANCE, f"step {step}"
