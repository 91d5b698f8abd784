"""The engine's warm-up (Engine.warm_up): it runs every prompt shape class and decode steps,
and leaves nothing behind that changes what the next request computes."""

from __future__ import annotations

import torch

from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.sampling import SamplingParams


def test_a_warmed_engine_answers_exactly_as_a_cold_one(tiny_pack):
    prompt = [5, 17, 300, 42, 7, 99, 120, 64]
    params = SamplingParams(max_tokens=6, stop_token_ids=())
    cold = load_engine(tiny_pack).generator.generate(prompt, params)
    engine = load_engine(tiny_pack)
    assert engine.warm_up() == {}  # on a CPU nothing is compiled per shape: nothing to do
    lengths, depth = engine.warm_up_plan()  # what a GPU engine runs, run here through the same path
    forward, sizes = engine.step.forward, []

    def seen(tokens, state, *args, **kwargs):  # the attention caches' sizes decode steps ran with
        if tokens.shape[0] == 1:
            sizes.append({cache.capacity for cache in state.attention.values()})
        return forward(tokens, state, *args, **kwargs)

    engine.step.forward = seen
    seconds = engine.generator.warm_up(lengths, prompt_depth=depth)
    engine.step.forward = forward
    cfg = engine.model.config
    assert "decode" in seconds and "decode_larger_context" in seconds and len(seconds) >= 5
    # two sizes, the generator's own last: a decode graph is built for a second size once
    assert len(sizes) == 6 and len({frozenset(s) for s in sizes}) == 2
    assert sizes[-1] == {cache.capacity for cache in engine.generator._state.attention.values()}
    assert f"prompt_{cfg.indexer_budget + 2 * cfg.indexer_compress_ratio + 1}" in seconds  # past the QSA budget
    warmed = engine.generator.generate(prompt, params)
    assert warmed.token_ids == cold.token_ids


def test_a_shallow_forward_runs_only_its_layers(tiny_pack):
    engine = load_engine(tiny_pack)
    model, cfg = engine.model, engine.model.config
    first_attention = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_linear(i))
    state = model.new_state()
    state.reserve(64)
    model.forward(torch.arange(20), state, depth=first_attention + 1)
    assert state.attention[first_attention].length == 20
    later = [i for i in range(first_attention + 1, cfg.num_hidden_layers) if not cfg.is_linear(i)]
    assert later and all(state.attention[i].length == 0 for i in later), "layers past the depth must not run"
