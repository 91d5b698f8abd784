"""prompt_attention (a prompt's sparse QSA attention over each query's key blocks) against
prompt_attention_reference, masked SDPA in float32. Tiny shapes for the interpreter: 2 KV heads,
group 3, head_dim 32 (and 24), 9 queries at positions 13..21, blocks of 4 keys (the real ratio).

Tolerances, max abs error / max |reference|, as test_decode_attention.py states them:
  float32  1e-5: IEEE float32 dots and an online softmax in float32 against SDPA in float32.
  bfloat16 2^-7: the reference takes the same bf16 values in float32; the kernel rounds its output
           (and on CUDA the probabilities for the p v dot) to bf16.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import relative_error

pytest.importorskip("triton")

KV_HEADS, GROUP, HD, RATIO = 2, 3, 32, 4
FIRST, TOKENS = 13, 9


def _inputs(dtype, device, seed=0, hd=HD, length=FIRST + TOKENS):
    generator = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(TOKENS, KV_HEADS * GROUP, hd, generator=generator)  # peakier than N(0, 1) scores
    keys = torch.randn(KV_HEADS, length, hd, generator=generator)
    values = torch.randn(KV_HEADS, length, hd, generator=generator)
    return (t.to(device, dtype) for t in (q, keys, values))


def _blocks(device, seed=0, picks=2, width=4):
    """Per query: `picks` random complete blocks (or all there are), its own incomplete block, -1 pads."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for position in range(FIRST, FIRST + TOKENS):
        complete = (position + 1) // RATIO
        chosen = torch.randperm(complete, generator=generator)[:picks].tolist()
        rows.append(chosen + [complete] + [-1] * (width - len(chosen) - 1))
    return torch.tensor(rows, dtype=torch.int32, device=device)


def _run(q, keys, values, blocks, first=FIRST, **kwargs):
    from flashpack.runtime.kernels.prompt_attention import prompt_attention

    return prompt_attention(q, keys, values, blocks, first, RATIO, q.shape[-1] ** -0.5, **kwargs)


def _reference(q, keys, values, blocks, first=FIRST):
    from flashpack.runtime.kernels.reference import prompt_attention_reference

    return prompt_attention_reference(q, keys, values, blocks, first, RATIO, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("block_n", [16, 32])
def test_float32_matches_reference(triton_device, block_n):
    q, keys, values = _inputs(torch.float32, triton_device)
    blocks = _blocks(triton_device, width=7)  # 7 blocks: padded to 2 steps of 4 blocks at block_n 16
    out = _run(q, keys, values, blocks, block_n=block_n)
    assert out.shape == q.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert relative_error(out, _reference(q, keys, values, blocks)) <= 1e-5


def test_bf16_matches_reference(triton_device):
    q, keys, values = _inputs(torch.bfloat16, triton_device, seed=7)
    blocks = _blocks(triton_device, seed=7)
    out = _run(q, keys, values, blocks)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, _reference(q, keys, values, blocks)) <= 2.0**-7


def test_unpicked_and_future_keys_are_never_read(triton_device):
    """NaN in every key and value a query may not see (unpicked blocks, positions past the last
    query, a longer buffer's tail) leaves no trace: the gathers are masked per key."""
    q, keys, values = _inputs(torch.float32, triton_device, seed=4, length=FIRST + TOKENS + 6)
    blocks = _blocks(triton_device, seed=4, picks=1)
    want = _reference(q, keys, values, blocks)
    from flashpack.runtime.kernels.reference import prompt_keep_mask

    seen = prompt_keep_mask(blocks, FIRST, RATIO, keys.shape[1]).any(0)
    keys[:, ~seen], values[:, ~seen] = float("nan"), float("nan")
    out = _run(q, keys, values, blocks)
    assert torch.isfinite(out).all() and relative_error(out, want) <= 1e-5


def test_views_and_odd_head_dim(triton_device):
    """q a view of a wider projection, keys/values views of a longer cache, head_dim 24 (padded to 32)."""
    hd = 24
    q, keys, values = _inputs(torch.float32, triton_device, seed=5, hd=hd, length=FIRST + TOKENS + 5)
    q = torch.cat([q, q], dim=-1)[:, :, :hd]
    keys, values = keys[:, :FIRST + TOKENS], values[:, 5:]
    blocks = _blocks(triton_device, seed=5)
    assert relative_error(_run(q, keys, values, blocks), _reference(q, keys, values, blocks)) <= 1e-5


def test_controls_fail(triton_device):
    """The tolerance can fail: blocks shifted by one, the other KV head's keys, a wrong first position."""
    q, keys, values = _inputs(torch.float32, triton_device, seed=6)
    blocks = _blocks(triton_device, seed=6)
    want = _reference(q, keys, values, blocks)
    shifted = torch.where(blocks > 0, blocks - 1, blocks)
    assert relative_error(_run(q, keys, values, shifted), want) > 0.1
    assert relative_error(_run(q, keys.flip(0), values, blocks), want) > 0.1
    assert relative_error(_run(q, keys, values, blocks, first=FIRST - 2), want) > 0.1


def test_rejects_misfits(triton_device):
    q, keys, values = _inputs(torch.float32, triton_device)
    blocks = _blocks(triton_device)
    from flashpack.runtime.kernels.prompt_attention import prompt_attention

    for args in [(q, keys, values[:, :-1], blocks, FIRST), (q, keys.half(), values, blocks, FIRST),
                 (q[:, :5], keys, values, blocks, FIRST), (q, keys, values, blocks[:-1], FIRST),
                 (q, keys, values, blocks, FIRST + 1)]:
        with pytest.raises(ValueError):
            prompt_attention(*args, RATIO, 0.1)
    with pytest.raises(ValueError):
        prompt_attention(q, keys, values, blocks, FIRST, 3, 0.1)  # a ratio not a power of two
