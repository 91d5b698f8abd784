"""The gated delta rule: the plain chunked form against the plain recurrent one and transformers'
own, grouped q/k heads, and flash-linear-attention's kernels against the plain forms on a GPU (they
do not run in Triton's CPU interpreter)."""

from __future__ import annotations

import inspect

import pytest
import torch
from reference_model import rel_err
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

from flashpack.runtime.model.delta_rule import (
    chunk_gated_delta_rule, delta_rule_positions, fla_available, gated_delta_rule, l2_normalised,
    plain_gated_delta_rule, recurrent_gated_delta_rule,
)

cuda_fla = pytest.mark.skipif(
    not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla-core (the cuda extra)"
)


def _inputs(length: int, key_heads: int, value_heads: int, dk: int, dv: int, device="cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v = rand(length, key_heads, dk), rand(length, key_heads, dk), rand(length, value_heads, dv)
    g = -torch.rand(length, value_heads, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(length, value_heads, generator=gen)
    state = rand(value_heads, dk, dv) * 0.5
    return tuple(x.to(device) for x in (q, k, v, g, beta, state))


@pytest.mark.parametrize("length", [1, 5, 63, 130])
def test_delta_rule_chunked_equals_recurrent_and_transformers(length):
    q, k, v, g, beta, state = _inputs(length, key_heads=3, value_heads=3, dk=20, dv=12)
    out_r, state_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    for chunk in (16, 64):
        out_c, state_c = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=chunk)
        assert rel_err(out_c, out_r) <= 1e-5 and rel_err(state_c, state_r) <= 1e-5
    # transformers' PyTorch form: with fla-core installed its hub-kernel hook would call fla's
    # CUDA kernel instead, which cannot take these CPU tensors
    reference = inspect.unwrap(hf.torch_recurrent_gated_delta_rule)
    ref_out, ref_state = reference(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    assert rel_err(out_r, ref_out[0]) <= 1e-5 and rel_err(state_r, ref_state[0]) <= 1e-5


def test_l2_normalised_is_transformers_l2norm_rounded_once():
    """The prompts' q and k normalised before fla's chunked rule (in place of its in-kernel l2norm):
    transformers' l2norm in float32, rounded to the input's dtype once; a control that skips the
    normalisation is far off."""
    x = torch.randn(37, 4, 128, generator=torch.Generator().manual_seed(3)) * 3
    expected = hf.l2norm(x.float(), dim=-1, eps=1e-6)
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 4e-3)):
        found = l2_normalised(x.to(dtype))
        assert found.dtype == dtype and rel_err(found.float(), expected) <= tolerance
    assert rel_err(x, expected) > 0.5


@pytest.mark.parametrize("length", [1, 70])
def test_each_key_head_serves_consecutive_value_heads(length):
    q, k, v, g, beta, state = _inputs(length, key_heads=2, value_heads=6, dk=16, dv=8)
    out, final = gated_delta_rule(q, k, v, g, beta, state, backend="reference")
    expanded = (q.repeat_interleave(3, dim=1), k.repeat_interleave(3, dim=1))
    step_out, step_state = state, None
    outs = []
    for t in range(length):  # the one-token recurrence, token by token
        o, step_state = recurrent_gated_delta_rule(
            expanded[0][t:t + 1], expanded[1][t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], step_out,
        )
        step_out = step_state
        outs.append(o)
    assert rel_err(out, torch.cat(outs)) <= 1e-5 and rel_err(final, step_state) <= 1e-5


@pytest.mark.parametrize("length, key_heads, value_heads", [(1, 2, 6), (2, 4, 8), (5, 2, 6), (17, 3, 3)])
def test_a_checked_steps_positions_are_the_one_token_steps_bit_for_bit(length, key_heads, value_heads):
    """delta_rule_positions runs the plain rule's tokens in one pass; each output and each state after
    a token is exactly what that token's one-token call computes (a speculative step must round as
    plain decoding does)."""
    q, k, v, g, beta, state = _inputs(length, key_heads, value_heads, dk=16, dv=8, seed=length)
    out, states = delta_rule_positions(plain_gated_delta_rule, q, k, v, g, beta, state)
    assert states.shape == (length, value_heads, 16, 8)
    for t in range(length):
        step_out, state = plain_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        assert torch.equal(out[t:t + 1], step_out) and torch.equal(states[t], state), t


def test_steps_up_to_recurrent_max_tokens_take_the_recurrence():
    """A short step by the recurrence (each token's arithmetic as decode does it) where asked, by
    chunks otherwise: each bit for bit the form it names."""
    q, k, v, g, beta, state = _inputs(5, key_heads=2, value_heads=4, dk=16, dv=8)
    expanded = (q.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1))
    recurrent = recurrent_gated_delta_rule(*expanded, v, g, beta, state)
    chunked = chunk_gated_delta_rule(*expanded, v, g, beta, state)
    for limit, expected in ((1, chunked), (4, chunked), (5, recurrent), (16, recurrent)):
        found = gated_delta_rule(q, k, v, g, beta, state, backend="reference", recurrent_max_tokens=limit)
        assert all(torch.equal(a, b) for a, b in zip(found, expected)), limit
    assert not torch.equal(recurrent[0], chunked[0])  # the two forms round differently: the check can fail


@cuda_fla
@pytest.mark.parametrize("length,recurrent_max_tokens", [(1, 1), (5, 1), (200, 1), (5, 16), (16, 16), (92, 128)])
def test_fla_kernels_match_the_plain_rule(length, recurrent_max_tokens):
    """Real head shapes (16 key heads of 128, 32 value heads of 128), bf16 projections as the
    engine feeds them; tolerance 2e-2 relative: bf16 inputs and output, fp32 state both ways. Short
    steps by fla's recurrent kernel too, where asked."""
    q, k, v, g, beta, state = _inputs(length, key_heads=16, value_heads=32, dk=128, dv=128, device="cuda")
    q, k, v = (x.bfloat16() for x in (q, k, v))
    expected_out, expected_state = gated_delta_rule(q, k, v, g, beta, state, backend="reference")
    kept = state.clone()
    out, final = gated_delta_rule(q, k, v, g, beta, state, backend="triton", recurrent_max_tokens=recurrent_max_tokens)
    assert torch.equal(state, kept)
    assert rel_err(out, expected_out) <= 2e-2 and rel_err(final, expected_state) <= 2e-2
    # Control: value heads grouped the other way round (interleaved) must not pass.
    shuffled = v.unflatten(1, (2, 16)).transpose(1, 2).flatten(1, 2)
    wrong, _ = gated_delta_rule(q, k, shuffled, g, beta, state, backend="triton")
    assert rel_err(wrong.unflatten(1, (16, 2)).transpose(1, 2).flatten(1, 2), expected_out) > 0.1
