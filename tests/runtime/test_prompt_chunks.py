"""Short prompts as checked steps (Step.prompt_graphs_max_tokens, checked_graphs.chunk_lengths).

A follow-up's few new tokens after a restored state run as tracked steps from the checked graphs'
pieces, in chunks of 16, 8, 4, 3 and 2 tokens, each kept whole. They must compute what one-token
decode steps of the same tokens compute from the decode graphs' pieces (rel 1e-5 on a CPU in
float32; the reference is the decode pieces, not the eager layers, for the reason
test_checked_graphs.py gives: both graph paths pick the indexer's blocks over the whole buffer),
leave the state those steps leave (the decode steps after it agree too), and give at each mark the
state decoding reaches there. Controls must go wrong: chunks kept a token short, and marks that
share the live state's buffers rather than copy them. On a GPU the pieces are captured, and a
follow-up through a restored state greedily decodes what the whole follow-up in chunks decodes.
"""

from __future__ import annotations

import pytest
import torch

from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.checked_graphs import PROMPT_CHUNKS, CheckedGraphs, chunk_lengths
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.generate import Generator
from flashpack.runtime.model.deltanet import GatedDeltaNet
from flashpack.runtime.sampling import SamplingParams
from flashpack.runtime.state import DeltaNetState, SequenceState
from flashpack.runtime.tokenizer import PackTokenizer
from tests.runtime.test_checked_graphs import TOLERANCE, ReplayLikeCall, _steps, _tiered_steps, _worst

ROOM = 128  # no attention cache grows within a run: the pieces stay bound


def _tokens(seed: int, count: int) -> torch.Tensor:
    return torch.randint(0, 1000, (count,), generator=torch.Generator().manual_seed(seed))


class StaticOutputs(ReplayLikeCall):
    """A replay-like call (test_checked_graphs.ReplayLikeCall) whose every call returns its outputs
    in the same tensors, as a captured graph's replays do."""

    outputs = None

    def __call__(self, *inputs):
        found = super().__call__(*inputs)
        if self.outputs is None:
            self.outputs = tuple(tensor.clone() for tensor in found)
        else:
            for kept, tensor in zip(self.outputs, found):
                kept.copy_(tensor)
        return self.outputs


def _chunked_steps(tiny_pack, device: str = "cpu", most: int = 64):
    """(a step decoding from graph pieces, the same with short prompts in checked steps); on a CPU
    the checked pieces' outputs are static, as a replay's."""
    plain, pieces = _steps(tiny_pack, device)
    if device == "cpu":
        checked = pieces.checked
        pieces.checked = CheckedGraphs(checked.layers, checked.experts,
                                       make_call=lambda fn, kept: StaticOutputs(fn, lambda: pieces.checked._state))
    pieces.prompt_graphs_max_tokens = most
    return plain, pieces


def _decoded(step, prompt, follow_up, after: int, marks=()):
    """The prompt, then the follow-up one token a step, then `after` tokens decoded greedily:
    (the follow-up's last logits, the decoded steps' logits, a copy of the state at each mark,
    the follow-up's streams)."""
    state = step.new_state()
    state.reserve(ROOM)
    step.forward(prompt, state, last_only=True)
    at_marks, streams = [], []
    for index, token in enumerate(follow_up):
        out = step.forward(token[None], state)
        streams.append(out.streams.clone())
        if index + 1 in marks:
            at_marks.append(state.snapshot())
    return out.logits[-1:], _decode(step, state, out.logits, after), at_marks, torch.cat(streams)


def _chunked(step, prompt, follow_up, after: int, marks=()):
    state = step.new_state()
    state.reserve(ROOM)
    step.forward(prompt, state, last_only=True)
    out = step.forward(follow_up, state, last_only=True, marks=list(marks))
    return out.logits, _decode(step, state, out.logits, after), out.marked or [], out.streams


def _decode(step, state, logits, count: int) -> list[torch.Tensor]:
    found = []
    for _ in range(count):
        logits = step.forward(logits[-1].argmax()[None], state).logits
        found.append(logits)
    return found


def _next_after(step, saved, token: int) -> torch.Tensor:
    """The logits of one more token decoded from a saved state."""
    state = step.new_state()
    state.reserve(ROOM)
    state.restore(saved)
    return step.forward(torch.tensor([token]), state).logits


def test_chunk_lengths_cut_a_prompt_into_the_warmed_lengths():
    for count in range(2, 200):
        lengths = chunk_lengths(count)
        assert sum(lengths) == count and set(lengths) <= set(PROMPT_CHUNKS)
        assert len(lengths) <= count // 16 + 4  # 16s, then at most 8 + 4 + 2 + 3
    assert chunk_lengths(92) == [16] * 5 + [8, 4]
    assert chunk_lengths(17) == [8, 4, 2, 3]
    with pytest.raises(ValueError):
        chunk_lengths(1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below captures the pieces")
@pytest.mark.parametrize("count", [2, 3, 17, 37, 50])
def test_a_prompt_in_checked_steps_computes_plain_decoding_on_cpu(tiny_pack, count):
    plain, pieces = _chunked_steps(tiny_pack)
    prompt, follow_up = _tokens(2, 20), _tokens(count, count)  # the prompt past the indexer budget
    expected_last, expected_after, _, expected_streams = _decoded(plain, prompt, follow_up, after=4)
    got_last, got_after, _, got_streams = _chunked(pieces, prompt, follow_up, after=4)
    assert _worst([got_last, *got_after], [expected_last, *expected_after]) < TOLERANCE
    assert _worst(got_streams, expected_streams) < TOLERANCE  # every position's (the MTP head reads them)
    # both prompts ran as checked steps
    assert set(pieces.checked._pieces) == {*chunk_lengths(20), *chunk_lengths(count)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below captures the pieces")
def test_marks_inside_a_chunked_prompt_hold_the_state_decoding_reaches_there(tiny_pack):
    plain, pieces = _chunked_steps(tiny_pack)
    prompt, follow_up, marks = _tokens(2, 20), _tokens(5, 41), [9, 30]
    _, _, expected, _ = _decoded(plain, prompt, follow_up, after=0, marks=marks)
    _, _, got, _ = _chunked(pieces, prompt, follow_up, after=0, marks=marks)
    assert [at.position for at in got] == [20 + mark for mark in marks]
    backbone = pieces.config.num_hidden_layers
    assert all(cache.length == 0 for at in got for layer, cache in at.attention.items() if layer >= backbone)
    token = int(follow_up[0])
    assert _worst([_next_after(pieces, at, token) for at in got],
                  [_next_after(plain, at, token) for at in expected]) < TOLERANCE


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below captures the pieces")
def test_control_chunks_kept_a_token_short_go_wrong(tiny_pack, monkeypatch):
    """Each chunk is kept whole; one whose last token is rolled back leaves a state the decode
    steps after it (and the last logits' successors) disagree with."""
    plain, pieces = _chunked_steps(tiny_pack)
    rewind = SequenceState.rewind
    monkeypatch.setattr(SequenceState, "rewind", lambda self, kept: rewind(self, max(1, kept - 1)))
    prompt, follow_up = _tokens(2, 20), _tokens(37, 37)
    expected_last, expected_after, _, _ = _decoded(plain, prompt, follow_up, after=4)
    got_last, got_after, _, _ = _chunked(pieces, prompt, follow_up, after=4)
    assert _worst(got_after, expected_after) > 1e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below captures the pieces")
def test_control_marks_that_share_the_live_state_go_wrong(tiny_pack, monkeypatch):
    """A mark's DeltaNet part must be a copy: one that shares the state's buffers ends up holding
    the step's end."""
    plain, pieces = _chunked_steps(tiny_pack)
    prompt, follow_up, marks = _tokens(2, 20), _tokens(5, 41), [9, 30]
    _, _, expected, _ = _decoded(plain, prompt, follow_up, after=0, marks=marks)
    monkeypatch.setattr(DeltaNetState, "copy", lambda self: DeltaNetState(self.conv, self.recurrent))
    _, _, got, _ = _chunked(pieces, prompt, follow_up, after=0, marks=marks)
    token = int(follow_up[0])
    assert _worst([_next_after(pieces, at, token) for at in got],
                  [_next_after(plain, at, token) for at in expected]) > 1e-3


def test_compiled_mixers_may_compile_every_step_length_of_both_layer_kinds(tiny_pack, monkeypatch):
    """checked_mixer is compiled once a step length and layer kind (its token loop unrolled): the
    chunks' lengths beside speculation's are more than TorchDynamo's default 8 compiles a function,
    past which a length would run uncompiled (seen on the CPU: lengths 8 and 16 after 2-5)."""
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    _, pieces = _steps(tiny_pack)
    CheckedGraphs(pieces.checked.layers, pieces.checked.experts, compiled=True, compile_mixers=True)
    assert torch._dynamo.config.recompile_limit >= 2 * (len({*PROMPT_CHUNKS, 5}))


def test_which_prompts_run_in_chunks(tiny_pack):
    _, pieces = _chunked_steps(tiny_pack, most=24)
    state = pieces.new_state()
    assert pieces._prompt_in_chunks(24, state, ()) and pieces._prompt_in_chunks(2, state, ())
    assert not pieces._prompt_in_chunks(25, state, ())  # past the setting: one eager step
    assert not pieces._prompt_in_chunks(1, state, ())  # a decode step
    assert not pieces._prompt_in_chunks(20, state, (10, 11))  # a 1-token segment between marks
    state.track()
    assert not pieces._prompt_in_chunks(5, state, ())  # a speculative checked step
    pieces.prompt_graphs_max_tokens = 0
    assert not pieces._prompt_in_chunks(5, pieces.new_state(), ())
    (_, tiered), stores = _tiered_steps(tiny_pack, 60, 300)
    tiered.prompt_graphs_max_tokens = 64
    assert not tiered._prompt_in_chunks(5, tiered.new_state(), ())  # through a store: fetched once, eagerly
    for store in stores:
        store.close()


def test_the_warm_up_runs_each_chunk_length_twice_on_the_generators_state(tiny_pack):
    """So that the first follow-up replays: each length's first run compiles, the second captures
    (CheckedGraphs.warming), on the state the requests reuse."""
    _, pieces = _chunked_steps(tiny_pack, most=16)
    generator = Generator(pieces, PackTokenizer.load(tiny_pack))
    generator.warm_up([], decode_steps=1)
    assert pieces.checked.bound(generator._state)
    checked = pieces.checked
    checked.make_call = None  # read the counts as a GPU's graphs would (plain calls never warm up)
    assert not any(checked.warming(length, generator._state) for length in PROMPT_CHUNKS)
    assert checked.warming(5, generator._state)  # a length no chunk takes


def _recorded_checked_steps(step) -> list[int]:
    counts, run = [], step.checked.run

    def recorded(streams, tokens, state):
        counts.append(tokens.shape[0])
        return run(streams, tokens, state)

    step.checked.run = recorded
    return counts


def test_a_request_on_a_state_the_chunk_graphs_are_cold_for_makes_them_at_its_end(tiny_pack, monkeypatch):
    """Where the state's buffers moved (attention caches that grew), the chunk lengths' graphs are
    made again at the request's end, each length twice, not at the next follow-up's first token;
    where they are warm, nothing runs; and nothing where the caches have no room for them."""
    _, pieces = _chunked_steps(tiny_pack, most=16)
    generator = Generator(pieces, PackTokenizer.load(tiny_pack))
    steps = _recorded_checked_steps(pieces)
    cold = True
    monkeypatch.setattr(pieces, "warming", lambda tokens, state: cold)
    params = SamplingParams(max_tokens=3)
    prompt = _tokens(3, 30).tolist()  # past the setting: one eager step
    generator._state = pieces.new_state()
    generator._state.reserve(256)  # room for the prompt, its reply and the chunks' 2 x 33 tokens
    reply = generator.generate(prompt, params).token_ids
    assert steps == list(PROMPT_CHUNKS) * 2
    cold, steps[:] = False, []
    assert generator.generate(prompt, params).token_ids == reply
    assert steps == []
    cold, generator._state = True, None  # a new state's caches of 64 positions: 30 + 3 + 66 do not fit
    assert generator.generate(prompt, params).token_ids == reply
    assert steps == []


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@needs_gpu
def test_captured_chunks_compute_plain_decoding(tiny_pack):
    """Every position's streams before the final norm, held to 1e-4, and the logits. The reference
    prefills its 20-token prompt by fla's recurrent kernel, as the chunks run it token by token: by
    the chunked kernel, whose float32 tl.dot products take Triton's default precision (TF32 on
    Hopper), the state after the prompt differs by that rounding, and the first follow-up row by
    3.7e-4 on an H100 (4.3e-6 with TRITON_F32_DEFAULT=ieee). A failure names the rows past 1e-5."""
    plain, pieces = _chunked_steps(tiny_pack, "cuda")
    prompt, follow_up = _tokens(2, 20).cuda(), _tokens(37, 37).cuda()
    for module in plain.model.modules():
        if isinstance(module, GatedDeltaNet):
            module.recurrent_max_tokens = len(prompt)
    for _ in range(3):  # the chunks' lengths run eagerly, are captured, then replayed
        got_last, got_after, _, got_streams = _chunked(pieces, prompt, follow_up, after=4)
    expected_last, expected_after, _, expected_streams = _decoded(plain, prompt, follow_up, after=4)
    assert _worst([got_last, *got_after], [expected_last, *expected_after]) < 1e-4
    rows = [float((a - b).norm() / b.norm()) for a, b in zip(got_streams, expected_streams)]
    assert max(rows) < 1e-4, [f"{row}: {error:.1e}" for row, error in enumerate(rows) if error > 1e-5]
    assert all(call.graph is not None for _, call in pieces.checked._pieces[16])


@needs_gpu
def test_a_follow_up_in_chunks_on_the_gpu_gives_the_full_prompts_greedy_output(tiny_pack):
    """A prompt, then a follow-up restoring its state and prefilling its new tokens in chunks: the
    tokens the engine decodes for the whole follow-up run without reuse, in chunks too (both graph
    paths: the eager step breaks the indexer's ties of the tiny model over other blocks)."""
    engine = load_engine(tiny_pack, EngineConfig(device="cuda", dtype="float32", speculate="off",
                                                 prompt_graphs_max_tokens=128))
    engine.warm_up()
    prompt = _tokens(2, 40).tolist()
    params = SamplingParams(max_tokens=12)
    first = engine.generator.generate(prompt, params)
    follow_up = prompt + first.token_ids + _tokens(7, 29).tolist()
    chunked = engine.generator.generate(follow_up, params)
    assert chunked.cached_tokens > 0
    cache, engine.generator.prefix_cache = engine.generator.prefix_cache, None
    whole = engine.generator.generate(follow_up, params)
    engine.generator.prefix_cache = cache
    assert whole.cached_tokens == 0 and chunked.token_ids == whole.token_ids
    engine.close()
