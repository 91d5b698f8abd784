"""The engine's entry points: `moe_experts` and `fp8_linear` pick a backend and agree with the
reference either way (the reference side needs no triton)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_cases import make_pool, relative_error, routing

from flashpack.convert.nvfp4 import quantize_fp8_rows
from flashpack.layout.records import RecordGeometry
from flashpack.runtime.kernels import (
    ExpertBank, expert_swiglu_reference, fp8_linear, fp8_linear_reference, moe_experts, use_triton,
)
from flashpack.runtime.kernels.dispatch import DECODE_MAX_TOKENS


def test_backend_choice():
    assert not use_triton("cpu")  # the interpreter only when asked for
    assert not use_triton("cpu", "reference")
    assert use_triton("cpu", "triton")
    with pytest.raises(ValueError):
        use_triton("cpu", "fast")


def test_reference_backend_is_the_reference(make_bank, device):
    bank = make_bank(80, 48, 3, seed=0)
    slots, weights = routing(2, 3, 2, seed=1, device=device)
    x = torch.randn(2, 80, generator=torch.Generator().manual_seed(2)).to(device)
    expected = expert_swiglu_reference(x, bank, slots, weights)
    assert torch.equal(moe_experts(x, bank, slots, weights, backend="reference"), expected)
    out = torch.full_like(x, float("nan"))
    assert moe_experts(x, bank, slots, weights, out=out, backend="reference") is out
    assert torch.equal(out, expected)


@pytest.mark.parametrize("tokens", [2, DECODE_MAX_TOKENS + 1])
def test_auto_backend_agrees(triton_device, make_bank, tokens):
    """Up to DECODE_MAX_TOKENS tokens take the matvec kernels, more the grouped ones, at the default
    block sizes; on CUDA the grouped path runs bf16 (see test_expert_grouped for its bound). On a CPU
    "auto" is the reference, so the interpreter is asked for by name."""
    bank = make_bank(80, 48, 3, seed=3)
    slots, weights = routing(tokens, 3, 2, seed=4, device=triton_device)
    x = torch.randn(tokens, 80, generator=torch.Generator().manual_seed(5)).to(triton_device)
    tolerance = 1e-2 if triton_device.type == "cuda" and tokens > DECODE_MAX_TOKENS else 1e-5
    expected = expert_swiglu_reference(x, bank, slots, weights)
    backend = "auto" if triton_device.type == "cuda" else "triton"
    assert relative_error(moe_experts(x, bank, slots, weights, backend=backend), expected) <= tolerance


def test_fp8_linear_reference_backend(device):
    values, scale = quantize_fp8_rows(torch.randn(24, 32, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    expected = fp8_linear_reference(x, values, scale)
    assert torch.equal(fp8_linear(x, values, scale, backend="reference"), expected)
    assert relative_error(expected, x @ (values.float() * scale[:, None]).T) <= 1e-6


def test_bank_views_the_pool_in_place():
    geometry = RecordGeometry(80, 48)
    pool = make_pool(80, 48, 2, seed=0)
    bank = ExpertBank.from_pool(pool, geometry)
    assert bank.gate_nibbles.data_ptr() == pool.data_ptr()
    assert (bank.hidden, bank.intermediate, bank.num_experts) == (80, 48, 2)
    one = ExpertBank.from_record(pool[1, :geometry.length], geometry)
    assert torch.equal(one.down_scales[0].view(torch.uint8), bank.down_scales[1].view(torch.uint8))
    assert torch.equal(one.global_scales[0], bank.global_scales[1])


def test_a_bank_whose_nibbles_are_not_8_byte_aligned_is_refused():
    """The decode kernels read nibbles 8 bytes (one 16-element group) at a time: gate nibbles viewed
    from a byte 4 past an 8-byte boundary must not pass (from_pool's views of records are aligned;
    a bank can be built from any views)."""
    bank = ExpertBank.from_pool(make_pool(80, 48, 2, seed=0), RecordGeometry(80, 48))
    shape = bank.gate_nibbles.shape
    base = torch.zeros(bank.gate_nibbles.numel() + 8, dtype=torch.uint8)
    assert base.data_ptr() % 8 == 0
    dataclasses.replace(bank, gate_nibbles=base[8:].view(shape))  # 8-byte aligned: accepted
    with pytest.raises(ValueError, match="8-byte boundary"):
        dataclasses.replace(bank, gate_nibbles=base[4:-4].view(shape))
    experts, rows, half_h = shape  # the second expert 4 bytes past a boundary: refused too
    strided = torch.zeros(experts * (rows * half_h + 4), dtype=torch.uint8).as_strided(
        shape, (rows * half_h + 4, half_h, 1))
    with pytest.raises(ValueError, match="8-byte boundary"):
        dataclasses.replace(bank, gate_nibbles=strided)


def test_an_fp32_engine_gets_ieee_dots_on_cuda():
    """Tensor-core bf16 dots only where the engine itself computes in 16 bits."""
    from flashpack.runtime.kernels.dispatch import tile_precision

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert tile_precision(cuda, torch.bfloat16) == "bf16" and tile_precision(cuda, torch.float16) == "bf16"
    assert tile_precision(cuda, torch.float32) == "fp32"
    assert tile_precision(cpu, torch.bfloat16) == "fp32"  # the interpreter's bf16 tl.dot is wrong


@pytest.mark.parametrize("tokens,rows,dtype,tile_max_tokens,path", [
    (1, 2048, torch.float32, 16, "matvec"),  # one token: always the matvec
    (3, 2047, torch.float32, 16, "matvec"),  # a few tokens of a short matrix (the router's stack)
    (3, 2048, torch.float32, 16, "cuBLAS"),  # a few tokens of a tall one
    (5, 100, torch.bfloat16, 16, "tiles"),  # past matvec_max_tokens
    (16, 100, torch.float32, 16, "tiles"),
    (17, 100, torch.float32, 16, "cuBLAS"),  # a prompt's
    (5, 100, torch.float32, 0, "cuBLAS"),  # the tiles turned off
    (5, 100, torch.float16, 16, "cuBLAS"),  # FP16 weights are not rounded to bf16 for the dots
    (5, 2048, torch.float32, 16, "cuBLAS"),  # a tall one: cuBLAS reads it as fast
])
def test_dense_linear_takes_a_kernel_where_it_wins(monkeypatch, tokens, rows, dtype, tile_max_tokens, path):
    """dense_linear's choice between the matvec kernel, the tile kernel and F.linear (rows, tokens
    and dtype only), with the default matvec_max_tokens; the product is F.linear's whichever runs
    (test_matvec.py, test_tile_linear.py)."""
    from flashpack.runtime.kernels import dispatch

    calls = []
    linear = lambda x, w: torch.nn.functional.linear(x.float(), w.float()).to(x.dtype)  # noqa: E731
    monkeypatch.setattr(dispatch, "_dense_matvec", lambda x, w: calls.append("matvec") or linear(x, w))
    monkeypatch.setattr(dispatch, "_dense_tiles", lambda x, w: calls.append("tiles") or linear(x, w))
    x, weight = torch.randn(tokens, 16, dtype=dtype), torch.randn(rows, 16, dtype=dtype)
    assert dispatch.DENSE_MATVEC_MAX_TOKENS == 3
    out = dispatch.dense_linear(x, weight, backend="triton", tile_max_tokens=tile_max_tokens)
    # cuBLAS's product is F.linear's in the weights' dtype (FP16 may round a last bit otherwise)
    expected = linear(x, weight) if calls else torch.nn.functional.linear(x, weight)
    torch.testing.assert_close(out.float(), expected.float())
    assert calls == ([] if path == "cuBLAS" else [path])


@pytest.mark.parametrize("tokens,rows,given,matvec_max_tokens", [
    (1, 8192, 3, 1),  # one token: the matvec whatever the rows
    (3, 4095, 3, 3),  # a few tokens of a matrix under 4,096 rows (DeltaNet's output projection)
    (3, 4096, 3, 1),  # of a taller one: the few-token tiles
    (5, 100, 3, 3),  # past the default: the tile kernel decides by the count it is given
    (3, 100, 0, 0),  # 0: the tile kernel for every count
])
def test_fp8_linear_takes_the_matvec_where_it_wins(monkeypatch, tokens, rows, given, matvec_max_tokens):
    """fp8_linear's choice: the matvec count it hands the kernels, by rows and tokens."""
    from importlib import import_module

    from flashpack.runtime.kernels import dispatch

    tiles = import_module("flashpack.runtime.kernels.fp8_linear")  # the package's `fp8_linear` is the function
    seen = []
    monkeypatch.setattr(tiles, "fp8_linear_triton", lambda x, v, s, **kw: seen.append(kw["matvec_max_tokens"]))
    assert dispatch.FP8_MATVEC_MAX_TOKENS == 3
    values, scale = torch.zeros(rows, 16, dtype=torch.float8_e4m3fn), torch.ones(rows)
    dispatch.fp8_linear(torch.randn(tokens, 16), values, scale, backend="triton", matvec_max_tokens=given)
    assert seen == [matvec_max_tokens]
