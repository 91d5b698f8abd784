"""Projections a `--dense-fp8` pack stores as FP8 rows stay FP8 in the engine (DenseLinear).

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
from flashpack.runtime.model.linear import DenseLinear
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
    qkv = kept.layers[0].mixer.in_proj_qkv
    assert isinstance(qkv, DenseLinear) and qkv.weight is None and qkv.values.dtype == torch.float8_e4m3fn
    assert dequantised.layers[0].mixer.in_proj_qkv.weight is not None
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
