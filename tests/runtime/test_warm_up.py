"""The engine's warm-up (Engine.warm_up): it runs every prompt shape class and decode steps,
and leaves nothing behind that changes what the next request computes."""

from __future__ import annotations

import pytest
import torch

from flashpack.convert.synth.presets import SynthOptions, resolve_plan
from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.engine import warm_up_lengths
from flashpack.runtime.kernels.prompt_attention import key_block_steps
from flashpack.runtime.sampling import SamplingParams


def test_a_warmed_engine_answers_exactly_as_a_cold_one(tiny_pack):
    prompt = [5, 17, 300, 42, 7, 99, 120, 64]
    params = SamplingParams(max_tokens=6, stop_token_ids=())
    cold = load_engine(tiny_pack).generator.generate(prompt, params)
    engine = load_engine(tiny_pack)
    # on a CPU nothing is compiled per shape: only the heap is frozen (tests/runtime/test_collector.py)
    assert set(engine.warm_up()) == {"freeze_heap"}
    assert load_engine(tiny_pack, EngineConfig(freeze_heap=False)).warm_up() == {}
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
    assert "decode" in seconds and "decode_other_size" in seconds and len(seconds) >= 5
    # two sizes, the generator's own last: a decode graph is built for a second size once
    assert len(sizes) == 6 and len({frozenset(s) for s in sizes}) == 2
    assert min(min(s) for s in sizes) > cfg.indexer_budget  # both where decode scores the blocks
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


@pytest.mark.parametrize("preset", ["tiny", "full"])
def test_the_warm_up_prompts_reach_every_build_of_the_prompt_attention_kernel(preset):
    """A query chunk ending at position L reads min(budget blocks, L // ratio) + 1 key blocks, and the
    kernel is built once for each power of two of its steps over them: every prompt length up to
    twice the longest warm-up prompt falls in a class a warm-up prompt built (a chat turn of 528
    tokens built one on its first request on the H200 while the warm-up ran 16, 300, ... tokens)."""
    cfg = resolve_plan(SynthOptions(preset, format="nvfp4", layers=4, text_only=True)).cfg
    lengths = warm_up_lengths(cfg, 10**9)
    ratio, budget_blocks = cfg.indexer_compress_ratio, cfg.indexer_budget // cfg.indexer_compress_ratio
    built = lambda length: key_block_steps(min(budget_blocks, length // ratio) + 1, ratio)  # noqa: E731
    warmed = {built(length) for length in lengths}
    assert {built(length) for length in range(1, 2 * max(lengths))} == warmed
    if preset == "full":  # the real dimensions' budget spans classes the earlier lengths missed
        assert {built(length) for length in (16, 300, lengths[-2], lengths[-1])} < warmed
