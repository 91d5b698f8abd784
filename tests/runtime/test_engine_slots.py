"""The engine's bank path (experts as rows of a device bank, expert_paths.BankExperts) against the
dequantised path.

Both engines read the same pack; only how routed experts reach the MoE block differs. FP32 on the
CPU: the fused path (Triton interpreter or the plain reference, whichever the dispatcher takes
here) must give the dequantised engine's logits up to summation order, rel 1e-5.

On a CPU the dispatcher takes the kernels' plain reference, so these tests check the wiring (slot
lookup, chunked prompts); one short run forces the Triton kernels (the interpreter in CI), and
tests/kernels compares the kernels with the reference at length.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import flashpack.runtime.engine.expert_paths as expert_paths
from flashpack.layout.pack import Pack
from flashpack.runtime.engine.expert_paths import BankExperts
from flashpack.runtime.kernels import moe_experts, triton_available
from flashpack.runtime.kernels.dispatch import kernels_interpreted
from flashpack.runtime.model import Qwen4ExpModel
from flashpack.runtime.pack_source import PackExperts, PackWeights
from flashpack.runtime.store.resident import ResidentExperts

TOLERANCE = 1e-5


def _logits(model: Qwen4ExpModel, prompt: torch.Tensor, decode: list[int]) -> torch.Tensor:
    state = model.new_state()
    out = [model(prompt, state).logits]
    for token in decode:
        out.append(model(torch.tensor([token]), state).logits)
    return torch.cat(out)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def pack(tiny_pack):
    return Pack.open(tiny_pack)


@pytest.fixture(scope="module")
def reference_logits(pack):
    prompt = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(3))
    model = Qwen4ExpModel(PackWeights(pack), PackExperts(pack), dtype=torch.float32)
    return prompt, _logits(model, prompt, [5, 77, 300])


def test_resident_experts_match_dequantised_path(pack, reference_logits):
    prompt, expected = reference_logits
    resident = ResidentExperts(pack, "cpu", progress=False)
    model = Qwen4ExpModel(PackWeights(pack), BankExperts(resident), dtype=torch.float32)
    assert _rel(_logits(model, prompt, [5, 77, 300]), expected) < TOLERANCE
    cfg = pack.manifest.config
    assert resident.slot_table.shape == (cfg.num_hidden_layers + cfg.mtp_num_hidden_layers, cfg.num_experts)
    assert int(resident.slot_table.min()) >= 0


def test_moe_block_through_triton_kernels(pack, monkeypatch):
    """One MoE block (the interpreter is slow: a whole engine would take minutes)."""
    if not torch.cuda.is_available() and not (triton_available() and kernels_interpreted()):
        pytest.skip("the Triton kernels cannot run here (no GPU, interpreter not enabled)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(expert_paths, "moe_experts", partial(moe_experts, backend="triton"))
    x = torch.randn(2, pack.manifest.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(device)
    plain = Qwen4ExpModel(PackWeights(pack), PackExperts(pack), dtype=torch.float32, device=device)
    fused = Qwen4ExpModel(PackWeights(pack), BankExperts(ResidentExperts(pack, device, progress=False)),
                          dtype=torch.float32, device=device)
    assert _rel(fused.layers[2].moe(x), plain.layers[2].moe(x)) < TOLERANCE


def test_resident_control_swapped_nibbles_fails(pack, reference_logits):
    """A control that must break: swap the nibbles of every record's gate projection."""
    prompt, expected = reference_logits
    resident = ResidentExperts(pack, "cpu", progress=False)
    nibbles = resident.bank.gate_nibbles
    nibbles.copy_((nibbles << 4) | (nibbles >> 4))
    model = Qwen4ExpModel(PackWeights(pack), BankExperts(resident), dtype=torch.float32)
    assert _rel(_logits(model, prompt, [5, 77, 300]), expected) > 100 * TOLERANCE


def test_resident_rejects_a_corrupt_record(tiny_pack, tmp_path):
    import shutil

    from flashpack.errors import FlashpackError

    copy = tmp_path / "pack"
    shutil.copytree(tiny_pack, copy)
    record = Pack.open(copy).record_entry(2, 3)
    with open(copy / record.file, "r+b") as handle:
        handle.seek(record.offset + 10)
        byte = handle.read(1)
        handle.seek(record.offset + 10)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(FlashpackError, match="layer 2 expert 3"):
        ResidentExperts(Pack.open(copy), "cpu", progress=False)


def test_resident_counts_requests_as_device_hits(pack):
    resident = ResidentExperts(pack, "cpu", progress=False)
    model = Qwen4ExpModel(PackWeights(pack), BankExperts(resident), dtype=torch.float32)
    state = model.new_state()
    model(torch.arange(10), state)
    prompt = resident.stats.total().requests
    model(torch.tensor([3]), state)
    cfg = pack.manifest.config
    decode = resident.stats.total().requests - prompt
    assert decode == cfg.num_hidden_layers * cfg.num_experts_per_tok
    assert cfg.num_experts_per_tok <= prompt / cfg.num_hidden_layers <= cfg.num_experts
    assert resident.stats.total().device_hits == resident.stats.total().requests


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_resident_counts_a_prompts_distinct_experts(pack, device):
    """A prompt's requests are its distinct experts a layer; on a GPU the count is copied back
    without a wait and reaches the stats at the next count once it has landed."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    resident = ResidentExperts(pack, device, progress=False)
    top_k = pack.manifest.config.num_experts_per_tok
    picks = torch.tensor([[1, 2], [2, 3], [1, 4]], device=device)  # 4 distinct of 6
    resident.record_use(0, picks)
    if device == "cuda":
        torch.cuda.synchronize()
    resident.count_replay(1)
    assert resident.stats.layer(0).requests == 4 and resident.stats.layer(0).device_hits == 4
    assert resident.stats.layer(1).requests == top_k


def test_build_store_goes_resident_only_when_allowed_and_everything_fits(tiny_pack):
    from flashpack.runtime.store import TieredStore, build_store
    from flashpack.runtime.store.config import StoreConfig

    assert isinstance(build_store(tiny_pack, allow_resident=True), ResidentExperts)
    with build_store(tiny_pack) as store:
        assert isinstance(store, TieredStore)
    stride = Pack.open(tiny_pack).manifest.document["experts"]["record_stride"]
    with build_store(tiny_pack, StoreConfig(vram_budget=40 * stride), device_reserved=0, allow_resident=True) as store:
        assert isinstance(store, TieredStore)


def test_a_store_is_never_run_as_dequantised_weights(pack):
    """A source of device slots given to the model itself is refused: its records run in place
    through the engine's RoutedExperts, not through the plain path its `fetch` would allow."""
    with pytest.raises(TypeError, match="RoutedExperts"):
        Qwen4ExpModel(PackWeights(pack), ResidentExperts(pack, "cpu", progress=False), dtype=torch.float32)
