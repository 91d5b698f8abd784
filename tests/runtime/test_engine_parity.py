"""FP32 parity of flashpack's engine with transformers' qwen4_exp, layer by layer and over generation.

Tolerance: relative error (Frobenius) <= 1e-5 on every decoder layer's hc streams and on the logits;
greedy tokens identical. Prompts include EOS tokens (PLE document boundaries) and exceed the indexer
budget (16 tokens), so block selection, the tail and the pooled block cache are all exercised.
"""

from __future__ import annotations

import pytest
import torch
from reference_model import EOS, SwappedExperts, prompts, rel_err

TOL = 1e-5
PROMPTS = prompts()


def _reference_layers(bench, tokens: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    outputs = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: outputs.append(out[0].detach()))
             for layer in bench.reference.model.layers]
    try:
        with torch.no_grad():
            logits = bench.reference(torch.tensor([tokens])).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return outputs, logits


def _engine_layers(engine, tokens: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    outputs = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach())) for layer in engine.layers]
    try:
        logits = engine(torch.tensor(tokens), engine.new_state()).logits
    finally:
        for hook in hooks:
            hook.remove()
    return outputs, logits


@pytest.mark.parametrize("name", ["starts_with_eos", "eos_inside", "long_72_eos"])
def test_every_layer_and_logits_match_transformers(bench, engine, name):
    expected_layers, expected_logits = _reference_layers(bench, PROMPTS[name])
    actual_layers, actual_logits = _engine_layers(engine, PROMPTS[name])
    assert len(actual_layers) == len(expected_layers) == bench.weights.config.num_hidden_layers
    for layer, (actual, expected) in enumerate(zip(actual_layers, expected_layers)):
        assert rel_err(actual, expected) <= TOL, f"layer {layer}: {rel_err(actual, expected):.2e}"
    assert rel_err(actual_logits, expected_logits) <= TOL


def _greedy(engine, prompt: list[int], steps: int) -> list[int]:
    state = engine.new_state()
    logits = engine(torch.tensor(prompt), state, last_only=True).logits[-1]
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = engine(torch.tensor(tokens[-1:]), state).logits[-1]
    return tokens


@pytest.mark.parametrize("name", ["eos_inside", "long_44", "long_72_eos"])
def test_greedy_32_tokens_match_generate(bench, engine, name):
    prompt = PROMPTS[name]
    with torch.no_grad():
        generated = bench.reference.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()
    assert len(generated) == 32
    assert _greedy(engine, prompt, 32) == generated


@pytest.mark.parametrize("prefill", [1, 10])
def test_incremental_decode_matches_full_recompute(engine, prefill):
    """Prefill, then one token at a time: crosses the budget mid-decode (selection, tail, pooling);
    a 1-token prefill starts every conv, n-gram context and recurrent state from its initial value."""
    tokens = PROMPTS["long_72_eos"]
    full = engine(torch.tensor(tokens), engine.new_state()).logits
    state = engine.new_state()
    pieces = [engine(torch.tensor(tokens[:prefill]), state).logits]
    pieces += [engine(torch.tensor([t]), state).logits for t in tokens[prefill:]]
    assert state.position == len(tokens)
    assert rel_err(torch.cat(pieces), full) <= TOL


def test_chunked_prefill_matches_one_pass(engine):
    """Several multi-token steps with state (chunked prefill / speculative verification shape)."""
    tokens = PROMPTS["long_72_eos"]
    full = engine(torch.tensor(tokens), engine.new_state()).logits
    state = engine.new_state()
    cuts = [0, 3, 21, 22, 47, 72]
    pieces = [engine(torch.tensor(tokens[a:b]), state).logits for a, b in zip(cuts, cuts[1:])]
    assert rel_err(torch.cat(pieces), full) <= TOL


def test_prompt_query_chunks_do_not_change_results(engine, monkeypatch):
    from flashpack.runtime.model import qsa_attention

    tokens = PROMPTS["long_72_eos"]
    whole = engine(torch.tensor(tokens), engine.new_state()).logits
    monkeypatch.setattr(qsa_attention, "QUERY_CHUNK", 7)
    assert rel_err(engine(torch.tensor(tokens), engine.new_state()).logits, whole) <= TOL


def test_snapshot_restore_gives_identical_continuation(engine):
    tokens = PROMPTS["long_44"]
    state = engine.new_state()
    engine(torch.tensor(tokens), state)
    saved = state.snapshot()
    first = [engine(torch.tensor([t]), state).logits for t in (7, EOS, 9, 11)]
    # The snapshot is independent: decoding on `state` did not touch it.
    assert saved.position == len(tokens) and state.position == len(tokens) + 4
    buffers = [t.data_ptr() for s in state.deltanet.values() for t in (s.conv, s.recurrent)]
    for attempt in range(2):  # the snapshot survives a restore and serves again
        state.restore(saved)
        # restored in place: CUDA graphs captured against these buffers stay valid
        assert [t.data_ptr() for s in state.deltanet.values() for t in (s.conv, s.recurrent)] == buffers
        again = [engine(torch.tensor([t]), state).logits for t in (7, EOS, 9, 11)]
        for a, b in zip(first, again):
            assert torch.equal(a, b), f"attempt {attempt}"
    diverged = engine(torch.tensor([12]), saved).logits  # the snapshot itself is a usable state
    assert not torch.equal(diverged, first[0])


def test_fetch_is_one_call_per_layer_with_the_routed_union(bench, engine):
    bench.experts.calls.clear()
    engine(torch.tensor(PROMPTS["eos_inside"]), engine.new_state())
    layers = [layer for layer, _ in bench.experts.calls]
    assert layers == list(range(bench.weights.config.num_hidden_layers))
    for _, experts in bench.experts.calls:
        assert experts == sorted(set(experts)) and len(experts) >= bench.weights.config.num_experts_per_tok


# --- controls: each must break parity, or the checks above could not fail -------------------------

def _logits_error(bench, engine, name="long_72_eos") -> float:
    _, expected = _reference_layers(bench, PROMPTS[name])
    return rel_err(engine(torch.tensor(PROMPTS[name]), engine.new_state()).logits, expected)


def test_control_wrong_expert_weights_break_parity(bench):
    broken = bench.engine(experts=SwappedExperts(bench.experts, layer=5))
    assert _logits_error(bench, broken) > 1e-2


def test_control_zero_ple_rows_break_parity(bench):
    class ZeroRows:
        config = bench.weights.config
        dense = bench.weights.dense

        def ple_rows(self, ple_index, rows):
            return torch.zeros(rows.shape[0], self.config.ple_head_dim)

    assert _logits_error(bench, bench.engine(weights=ZeroRows())) > 1e-2


def test_control_attending_everything_breaks_parity(bench):
    """Full attention above the budget differs: the block selection is really in play."""
    engine = bench.engine()
    for layer in engine.layers:
        if not layer.linear:
            layer.mixer.indexer.block_topk = 10**6
    assert _logits_error(bench, engine) > 1e-4
