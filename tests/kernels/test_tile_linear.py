"""tile_linear (the tile kernel, its few-token tiles and column splits) against F.linear in float64.
Tolerance: relative error <= 1e-5 in float32 (precision="fp32", the interpreter's mode); at
precision="bf16" (CUDA) <= 1e-5 against the reference with x rounded to bf16 (BF16 weights are
exact), and 2^-7 for a bf16 output. Every output starts as NaN, so an element no split wrote fails.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import nan_like, relative_error

pytest.importorskip("triton")

ROWS, COLS = 70, 600  # neither divides a block; 600 columns split into chunks of 64 leave a short last one
BLOCKS = dict(block_n=32, block_k=64)


def _inputs(device, tokens, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(ROWS, COLS, generator=generator) / COLS**0.5
    x = torch.randn(tokens, COLS, generator=generator)
    return x.to(device), weight.to(device)


def _reference(x, weight):
    return torch.nn.functional.linear(x.double().cpu(), weight.double().cpu())


@pytest.mark.parametrize("tokens", [1, 5, 16, 17])
@pytest.mark.parametrize("splits", [1, 3, 10])
def test_fp32_matches_reference(triton_device, tokens, splits):
    """One split and several (3: chunks of 256 columns, the last short; 10: one chunk each), for a
    few tokens' tiles (1, 5, 16) and a prompt's (17)."""
    from flashpack.runtime.kernels.tile_linear import tile_linear

    x, weight = _inputs(triton_device, tokens, seed=tokens)
    out = tile_linear(x, weight, precision="fp32", splits=splits, out=nan_like((tokens, ROWS), torch.float32,
                                                                               triton_device), **BLOCKS)
    assert torch.isfinite(out).all()
    assert relative_error(out.cpu(), _reference(x, weight)) <= 1e-5


def test_column_splits_fill_the_gpu():
    """A short, wide matrix is split until the launch nears TARGET_PROGRAMS; a tall one, or a
    prompt, is not; no split is narrower than one chunk."""
    from flashpack.runtime.kernels.tile_linear import TARGET_PROGRAMS, column_splits, tile_blocks

    few = tile_blocks(5)
    assert column_splits(5, 324, 10240, few) == TARGET_PROGRAMS // 11  # 11 row tiles of 32
    assert column_splits(5, 12288, 2560, few) == 1  # 384 row tiles already
    assert column_splits(5, 16, 512, few) == 2  # two chunks of 256 columns at most
    assert column_splits(300, 324, 10240, tile_blocks(300)) == 1


def test_default_choice_matches_reference(triton_device):
    """The splits tile_linear picks itself, on a short wide matrix."""
    from flashpack.runtime.kernels.tile_linear import tile_linear

    x, weight = _inputs(triton_device, 4, seed=7)
    out = tile_linear(x, weight, precision="fp32", out=nan_like((4, ROWS), torch.float32, triton_device), block_k=64)
    assert relative_error(out.cpu(), _reference(x, weight)) <= 1e-5


def test_skipped_split_control(triton_device):
    """The check catches a launch that leaves one column split out: no tile's count completes, so
    nothing is written (the NaN stays), and a count that starts one short sums too early, without
    the last split's columns."""
    import triton
    import triton.language as tl

    from flashpack.runtime.kernels.tile_linear import _tile_kernel

    tokens, splits, split_cols, tiles = 3, 3, 256, triton.cdiv(ROWS, 32)
    x, weight = _inputs(triton_device, tokens, seed=8)

    def launch(programs, counters):
        out = nan_like((tokens, ROWS), torch.float32, triton_device)
        partial = torch.zeros(tokens, splits, ROWS, device=triton_device)
        _tile_kernel[(1, tiles, programs)](
            x, weight, weight, out, partial, counters, tokens, ROWS, COLS, SPLIT_C=split_cols, SPLITS=splits,
            FP8=False, SCALED=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, DOT=tl.float32)
        return out

    complete = launch(splits, torch.zeros(tiles, dtype=torch.int32, device=triton_device))
    assert relative_error(complete.cpu(), _reference(x, weight)) <= 1e-5
    assert torch.isnan(launch(splits - 1, torch.zeros(tiles, dtype=torch.int32, device=triton_device))).all()
    early = launch(splits - 1, torch.ones(tiles, dtype=torch.int32, device=triton_device))
    assert relative_error(early.cpu(), _reference(x, weight)) > 0.1


def test_split_counters_are_left_zero(triton_device):
    """Every split launch leaves its tiles' counters at zero, so the next launch (or a graph's replay)
    counts from scratch: the same product twice gives the same bits."""
    from flashpack.runtime.kernels.tile_linear import tile_counters, tile_linear

    x, weight = _inputs(triton_device, 5, seed=3)
    first = tile_linear(x, weight, precision="fp32", splits=3, **BLOCKS)
    assert not tile_counters(1, triton_device).any()
    assert torch.equal(tile_linear(x, weight, precision="fp32", splits=3, **BLOCKS), first)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs the GPU's concurrent programs")
def test_split_sums_are_deterministic_under_concurrency():
    """On a GPU a tile's splits finish in any order and its last one sums: 200 launches of a short,
    wide product split 24 ways give the same bits each time, and those of the reference to 1e-5."""
    from flashpack.runtime.kernels.tile_linear import tile_linear

    generator = torch.Generator().manual_seed(11)
    weight = (torch.randn(324, 10240, generator=generator) / 10240**0.5).cuda()
    x = torch.randn(5, 10240, generator=generator).cuda()
    runs = [tile_linear(x, weight, precision="fp32", splits=24) for _ in range(200)]
    assert all(torch.equal(run, runs[0]) for run in runs)
    want = torch.nn.functional.linear(x.double().cpu(), weight.double().cpu())
    assert relative_error(runs[0].cpu(), want) <= 1e-5


def test_rejects_what_does_not_fit(triton_device):
    from flashpack.runtime.kernels.tile_linear import tile_linear

    x, weight = _inputs(triton_device, 2)
    with pytest.raises(ValueError, match="do not fit"):
        tile_linear(x[:, :-1], weight, precision="fp32")
    with pytest.raises(ValueError, match="do not fit"):  # FP8 rows need their scales
        tile_linear(x, weight.to(torch.float8_e4m3fn), precision="fp32")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tensor-core dots need CUDA")
@pytest.mark.parametrize("tokens", [4, 5, 16])
def test_bf16_matches_reference(tokens):
    """BF16 weights at the engine's precision, split and not, into a bf16 output."""
    from flashpack.runtime.kernels.tile_linear import tile_linear

    x, weight = _inputs("cuda", tokens, seed=9)
    weight = weight.bfloat16()
    want = _reference(x.bfloat16(), weight)
    for splits in (1, 4):
        out = tile_linear(x.bfloat16(), weight, precision="bf16", splits=splits)
        assert out.dtype == torch.bfloat16
        assert relative_error(out.float().cpu(), want) <= 2.0**-7
        exact = tile_linear(x.bfloat16(), weight, precision="bf16", splits=splits,
                            out=torch.empty(tokens, ROWS, device="cuda"))
        assert relative_error(exact.cpu(), want) <= 1e-5
