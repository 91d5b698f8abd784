"""delta_rule_steps (one launch for a checked step's tokens, the state after each kept) against the
plain recurrence a token at a time, and on a GPU against fla's one-token kernel run a token at a time.

Against the plain form: float32 inputs, tolerance 1e-5 relative (the kernel normalises by a divide
where the plain form multiplies by rsqrt: a few ulps). Against fla (what plain decoding runs on a
GPU): the same arithmetic compiled otherwise, not bit for bit on an H100: the float32 states to
1e-5 relative, the bf16 outputs to one bf16 rounding (2^-7 relative, as the tile kernel's bf16 test)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import relative_error as rel_err

from flashpack.runtime.model.delta_rule import fla_available, fla_gated_delta_rule, plain_gated_delta_rule

pytest.importorskip("triton")

TOLERANCE = 1e-5


def _inputs(tokens: int, key_heads: int, value_heads: int, dk: int, dv: int, device, seed: int = 0):
    """q, k, v as the engine hands them over: columns of one [T, C] conv output, itself the transpose
    of a [C, T] (so no stride is 1 but a head's); g, beta [T, Hv]; the state before the step."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * key_heads * dk + value_heads * dv
    qkv = torch.randn(width, tokens, generator=gen).transpose(0, 1)
    q, k, v = torch.split(qkv, [key_heads * dk, key_heads * dk, value_heads * dv], dim=-1)
    q, k, v = q.unflatten(1, (key_heads, dk)), k.unflatten(1, (key_heads, dk)), v.unflatten(1, (value_heads, dv))
    g = -torch.rand(tokens, value_heads, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(tokens, value_heads, generator=gen)
    state = torch.randn(value_heads, dk, dv, generator=gen) * 0.5
    return tuple(x.to(device) for x in (q, k, v, g, beta, state))


@pytest.mark.parametrize("tokens, key_heads, value_heads, dk, dv", [
    (1, 2, 6, 16, 8),    # one token
    (5, 2, 6, 16, 12),   # a step of 4 drafts; value columns past a block of 8: masked lanes
    (3, 3, 3, 20, 4),    # key heads of 20 (a block of 32), fewer value columns than a block
    (16, 1, 2, 8, 8),    # the longest checked step
])
def test_matches_the_plain_recurrence_token_by_token(triton_device, tokens, key_heads, value_heads, dk, dv):
    from flashpack.runtime.kernels.delta_rule_steps import delta_rule_steps

    q, k, v, g, beta, state = _inputs(tokens, key_heads, value_heads, dk, dv, triton_device, seed=tokens)
    assert tokens == 1 or not q.is_contiguous()
    kept = state.clone()
    out, states = delta_rule_steps(q, k, v, g, beta, state)
    want_out, want_states = plain_gated_delta_rule(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), state.cpu(),
                                                   each=True)
    assert torch.equal(state, kept)
    assert out.shape == (tokens, value_heads, dv) and states.shape == (tokens, value_heads, dk, dv)
    assert rel_err(out.cpu(), want_out) <= TOLERANCE and rel_err(states.cpu(), want_states) <= TOLERANCE
    if tokens > 1:  # control: the states one token off (a rollback to the wrong token) are far apart
        assert rel_err(states[1:].cpu(), want_states[:-1]) > 0.05


def test_key_heads_serve_consecutive_value_heads(triton_device):
    """Control: the answer of the other grouping (key head h serving value heads h, h + Hk, ...) is
    far from the kernel's, so the comparison above would catch a kernel grouping that way."""
    from flashpack.runtime.kernels.delta_rule_steps import delta_rule_steps

    q, k, v, g, beta, state = _inputs(4, 2, 6, 16, 8, triton_device, seed=7)
    out, _ = delta_rule_steps(q, k, v, g, beta, state)
    cycled = (q.cpu().repeat(1, 3, 1), k.cpu().repeat(1, 3, 1))  # key heads 0 1 0 1 0 1
    wrong, _ = plain_gated_delta_rule(*cycled, v.cpu(), g.cpu(), beta.cpu(), state.cpu(), each=True)
    assert rel_err(out.cpu(), wrong) > 0.05


@pytest.mark.skipif(not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla-core")
@pytest.mark.parametrize("tokens", [2, 5, 16])
def test_rounds_as_fla_one_token_at_a_time(tokens):
    """Real head shapes (16 key heads of 128, 32 value heads of 128), bf16 projections: every output
    and every state as fla's kernel computes them, run a token at a time as plain decoding runs it."""
    from flashpack.runtime.kernels.delta_rule_steps import delta_rule_steps

    q, k, v, g, beta, state = _inputs(tokens, 16, 32, 128, 128, "cuda", seed=tokens)
    q, k, v, beta = (x.bfloat16() for x in (q, k, v, beta))
    out, states = delta_rule_steps(q, k, v, g, beta, state)
    outs, kept = [], []
    for t in range(tokens):
        step_out, state = fla_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        outs.append(step_out)
        kept.append(state)
    want_out, want_states = torch.cat(outs), torch.stack(kept)
    assert rel_err(states, want_states) <= TOLERANCE and rel_err(out, want_out) <= 2.0**-7
    assert rel_err(states[1:], want_states[:-1]) > 0.05  # control: the states one token off
