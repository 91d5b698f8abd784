"""decode_attention (split-K masked decode attention) against decode_attention_reference, the SDPA
call attend_step makes, in float32. Tiny shapes for the interpreter: 2 KV heads, group 3, head_dim
32 (and 24, not a power of two), capacities 37 and 100 with BLOCK_N 16 (neither a multiple of it).

Tolerances, max abs error / max |reference|:
  float32  1e-5: IEEE float32 dots and an online softmax in float32 against SDPA in float32.
  bfloat16 2^-7: the reference takes the same bf16 values in float32. Under the interpreter every dot
           is float32, so the only rounding is the output's (the interpreter truncates float32 ->
           bf16: < 2^-7 of a value; the GPU rounds to nearest, 2^-8); on CUDA the probabilities are
           also rounded to bf16 for the p v dot (each to 2^-9 relative), which stays well inside.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import nan_like, relative_error

pytest.importorskip("triton")

KV_HEADS, GROUP, HD = 2, 3, 32
BLOCK_N = 16
SCALE = HD**-0.5


def _inputs(capacity, dtype, device, seed=0, hd=HD):
    generator = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(KV_HEADS, GROUP, hd, generator=generator)  # peakier than N(0, 1) scores
    keys = torch.randn(KV_HEADS, capacity, hd, generator=generator)
    values = torch.randn(KV_HEADS, capacity, hd, generator=generator)
    return (t.to(device, dtype) for t in (q, keys, values))


def _mask(capacity, kept, device):
    keep = torch.zeros(capacity, dtype=torch.bool)
    keep[list(kept)] = True
    return keep.to(device)


def _run(q, keys, values, keep, scale=SCALE, **kwargs):
    from flashpack.runtime.kernels.decode_attention import decode_attention

    return decode_attention(q, keys, values, keep, scale, **{"block_n": BLOCK_N, **kwargs})


def _reference(q, keys, values, keep, scale=SCALE):
    from flashpack.runtime.kernels.reference import decode_attention_reference

    return decode_attention_reference(q, keys, values, keep, scale)


# (capacity, kept keys): a causal prefix; blocks of 4 with gaps (blocks 16-31 and 64-79 of BLOCK_N
# keep nothing, so whole blocks are skipped); one key; every key
MASKS = {
    "prefix": (37, range(30)),
    "sparse": (100, [*range(4, 8), *range(12, 16), *range(36, 40), *range(56, 60), *range(84, 88), 96, 97, 98, 99]),
    "one key": (100, [53]),
    "all": (37, range(37)),
}


@pytest.mark.parametrize("mask", list(MASKS))
def test_float32_matches_reference(triton_device, mask):
    capacity, kept = MASKS[mask]
    q, keys, values = _inputs(capacity, torch.float32, triton_device, seed=len(mask))
    keep = _mask(capacity, kept, triton_device)
    out = _run(q, keys, values, keep, out=nan_like(q.shape, torch.float32, triton_device))
    assert out.shape == q.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert relative_error(out, _reference(q, keys, values, keep)) <= 1e-5


@pytest.mark.parametrize("mask", ["prefix", "sparse"])
def test_bf16_matches_reference(triton_device, mask):
    capacity, kept = MASKS[mask]
    q, keys, values = _inputs(capacity, torch.bfloat16, triton_device, seed=7)
    keep = _mask(capacity, kept, triton_device)
    out = _run(q, keys, values, keep)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, _reference(q, keys, values, keep)) <= 2.0**-7


@pytest.mark.parametrize("skip_empty", [True, False])
def test_splits_without_kept_keys(triton_device, skip_empty):
    """capacity 100 = 6 blocks of 16 + 4: with max_splits 8 each of the 7 blocks is a split and
    splits 0-4 keep nothing (their max is -inf); with max_splits 2, 2 splits of 4 blocks, the last
    ending past the capacity, the first keeping nothing. skip_empty=False walks the empty blocks
    through the softmax (the -inf guard)."""
    from flashpack.runtime.kernels.decode_attention import decode_splits

    assert decode_splits(100, BLOCK_N, 8) == (7, 1) and decode_splits(100, BLOCK_N, 2) == (2, 4)
    assert decode_splits(100, BLOCK_N, 3) == (2, 4) and decode_splits(1, BLOCK_N, 64) == (1, 1)
    q, keys, values = _inputs(100, torch.float32, triton_device, seed=3)
    keep = _mask(100, [*range(82, 90), 99], triton_device)
    want = _reference(q, keys, values, keep)
    for max_splits in (8, 2):
        out = _run(q, keys, values, keep, max_splits=max_splits, skip_empty=skip_empty)
        assert relative_error(out, want) <= 1e-5


@pytest.mark.parametrize("skip_empty", [True, False])
def test_unkept_keys_are_never_read(triton_device, skip_empty):
    """NaN keys and values where the mask is False (stale or unwritten cache rows) leave no trace:
    the loads are masked by keep (and blocks keeping nothing skipped, with skip_empty)."""
    capacity, kept = MASKS["sparse"]
    q, keys, values = _inputs(capacity, torch.float32, triton_device, seed=4)
    keep = _mask(capacity, kept, triton_device)
    want = _reference(q, keys, values, keep)
    keys[:, ~keep], values[:, ~keep] = float("nan"), float("nan")
    out = _run(q, keys, values, keep, skip_empty=skip_empty)
    assert torch.isfinite(out).all() and relative_error(out, want) <= 1e-5


def test_cache_views_and_odd_head_dim(triton_device):
    """keys/values as views of a longer cache (head stride != capacity * hd), q a view of the heads
    of one token as attend_step makes it, head_dim 24 (padded to 32 in the kernel)."""
    hd, capacity = 24, 37
    q, keys, values = _inputs(capacity + 11, torch.float32, triton_device, seed=5, hd=hd)
    q = q.reshape(1, KV_HEADS * GROUP, hd)[0].unflatten(0, (KV_HEADS, GROUP))
    keys, values = keys[:, :capacity], values[:, 5:5 + capacity]
    keep = _mask(capacity, [*range(9), *range(20, 37)], triton_device)
    out = _run(q, keys, values, keep, scale=hd**-0.5)
    assert relative_error(out, _reference(q, keys, values, keep, scale=hd**-0.5)) <= 1e-5


def test_controls_fail(triton_device):
    """The tolerance can fail: an inverted mask, and the keys of the other KV head."""
    capacity, kept = MASKS["sparse"]
    q, keys, values = _inputs(capacity, torch.float32, triton_device, seed=6)
    keep = _mask(capacity, kept, triton_device)
    want = _reference(q, keys, values, keep)
    assert relative_error(_run(q, keys, values, ~keep), want) > 0.1
    assert relative_error(_run(q, keys.flip(0), values, keep), want) > 0.1


def test_rejects_misfits(triton_device):
    q, keys, values = _inputs(37, torch.float32, triton_device)
    keep = _mask(37, range(37), triton_device)
    for args in [(q, keys, values, keep.float()), (q, keys, values[:, :36], keep), (q, keys.half(), values, keep),
                 (q[:, :, :16], keys, values, keep), (q, keys, values, keep[:36])]:
        with pytest.raises(ValueError):
            _run(*args)
    with pytest.raises(ValueError):
        _run(q, keys, values, keep, block_n=24)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_replay():
    """Captured once (scratch allocated in the capture), replayed after the mask and the cache change."""
    q, keys, values = _inputs(600, torch.bfloat16, "cuda", seed=8, hd=256)
    keep = torch.arange(600, device="cuda") < 100
    _run(q, keys, values, keep, block_n=32)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(q, keys, values, keep, block_n=32)
    keep.copy_(torch.arange(600, device="cuda") % 7 == 0)
    keys.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, _reference(q, keys, values, keep)) <= 2.0**-7
