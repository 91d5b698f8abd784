"""Projections a `--dense-fp8` pack stores as FP8 rows stay FP8 in the engine (DenseLinear,
StackedLinear).

The engine must compute what it computed when it dequantised them at load (rel 1e-5 in FP32: the
same products, summed in another order), hold the FP8 bytes rather than a dequantised copy, and the
store's budget must count them at their stored size. tests/test_verify.py checks the same pack
against transformers layer by layer.
"""

from __future__ import annotations

import pytest
import torch

from flashpack.convert.pipeline import convert
from flashpack.layout.nvfp4 import dequantize_fp8_rows
from flashpack.layout.pack import Pack
from flashpack.runtime.model import Qwen4ExpModel
from flashpack.runtime.model.linear import DenseLinear, StackedLinear
from flashpack.runtime.pack_source import PackExperts, PackWeights
from flashpack.runtime.store.build import resident_device_bytes


class DequantisedAtLoad:
    """A pack's weights without `dense_fp8`: every projection arrives dequantised, as it used to."""

    def __init__(self, pack: Pack):
        self._weights = PackWeights(pack)
        self.config = self._weights.config

    def dense(self, name: str) -> torch.Tensor:
        return self._weights.dense(name)

    def ple_rows(self, ple_index: int, rows: torch.Tensor) -> torch.Tensor:
        return self._weights.ple_rows(ple_index, rows)


@pytest.fixture(scope="module")
def fp8_pack(tiny_snapshot, tmp_path_factory):
    return Pack.open(convert(str(tiny_snapshot), tmp_path_factory.mktemp("fp8") / "fp8.pack", dense_fp8=True,
                             progress=False))


def _logits(model: Qwen4ExpModel) -> torch.Tensor:
    state = model.new_state()
    first = model(torch.arange(3, 40), state).logits
    return torch.cat([first, model(torch.tensor([17]), state).logits])


def test_fp8_projections_stay_fp8_and_compute_the_same(fp8_pack):
    kept = Qwen4ExpModel(PackWeights(fp8_pack), PackExperts(fp8_pack), dtype=torch.float32)
    dequantised = Qwen4ExpModel(DequantisedAtLoad(fp8_pack), PackExperts(fp8_pack), dtype=torch.float32)
    qkv = kept.layers[0].mixer.in_proj  # qkv and z stored FP8, b and a BF16
    assert qkv.is_fp8 == [True, True, False, False] and qkv.values.dtype == torch.float8_e4m3fn
    assert dequantised.layers[0].mixer.in_proj.values is None
    expected, got = _logits(dequantised), _logits(kept)
    assert float((got - expected).norm() / expected.norm()) < 1e-5

    qkv.row_scale.mul_(1.5)  # a control that must break: a wrong scale shows in the logits
    assert float((_logits(kept) - expected).norm() / expected.norm()) > 1e-3


def test_budget_counts_fp8_projections_at_their_stored_size(fp8_pack, tiny_pack):
    bf16 = resident_device_bytes(Pack.open(tiny_pack).manifest, "bfloat16")
    fp8 = resident_device_bytes(fp8_pack.manifest, "bfloat16")
    entries = fp8_pack.manifest.dense_tensors()
    saved = sum(t.shape[0] * t.shape[1] * 1 - 4 * t.shape[0] for t in entries.values() if t.row_scale)
    assert bf16 - fp8 == saved  # 2 bytes an element become 1, plus a float32 scale a row
    name = next(n for n, t in entries.items() if t.row_scale)
    values, scale = PackWeights(fp8_pack).dense_fp8(name)
    assert torch.equal(dequantize_fp8_rows(values, scale), PackWeights(fp8_pack).dense(name))


def test_stacked_projections_equal_separate_ones(fp8_pack):
    """FP8 and BF16 parts mixed, out of storage order: each output equals its projection run alone
    (rel 1e-6 in FP32: one stacked matrix product instead of several), in the order named."""
    weights = PackWeights(fp8_pack)
    names = [f"layers.0.linear_attn.{name}.weight" for name in ("in_proj_b", "in_proj_qkv", "in_proj_a", "in_proj_z")]
    stacked = StackedLinear(weights, names, torch.float32, "cpu")
    assert stacked.is_fp8 == [False, True, False, True]
    x = torch.randn(3, weights.config.hidden_size, generator=torch.Generator().manual_seed(0))
    outputs = stacked(x)
    for index, name in enumerate(names):
        alone = DenseLinear(weights, name, torch.float32, "cpu")(x)
        for got in (outputs[index], stacked.part(x, index)):
            assert got.shape == alone.shape and float((got - alone).norm() / alone.norm()) < 1e-6
    # control: b and a have the same shape, so a mix-up of the two would pass a shape check alone
    assert float((outputs[0] - outputs[2]).norm() / outputs[2].norm()) > 0.1
