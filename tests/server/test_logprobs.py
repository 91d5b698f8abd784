"""logprobs and echo through the server on the real tiny model, against a plain forward pass.

The reference is flashpack's own model run once over the whole sequence (`forward` with every
position's logits), log-softmax in float32: what the server must report at each position, whatever
sampled the tokens. Requests are the ones lm-eval's `local-completions` and the official clients send.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
import torch
from server_harness import KEY, MODEL, serving

from flashpack.runtime.logprobs import LogprobRequest
from flashpack.runtime.sampling import SamplingParams
from flashpack.runtime.server import ServerSettings
from server_fakes import scripted_engine

PROMPT = "def add(a, b):\n    return a + b\n"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def served(tiny_engine):
    with serving(tiny_engine, ServerSettings(model_name=MODEL, api_key=KEY, max_context=512)) as served:
        yield served


def post(served, body: dict, path: str = "/v1/completions") -> tuple[int, dict]:
    return served.raw("POST", path, json.dumps({"model": MODEL, **body}).encode(),
                      {"authorization": f"Bearer {KEY}", "content-type": "application/json"})


def reference(engine, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 log-probabilities; row t is the distribution of token t + 1."""
    state = engine.model.new_state()
    state.reserve(len(ids) + 1)
    return torch.log_softmax(engine.model.forward(torch.tensor(ids), state).logits.float(), dim=-1)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * abs(b) + 1e-6


def generations(served) -> float:
    _, text = served.raw("GET", "/metrics", headers={"authorization": f"Bearer {KEY}"})
    return sum(float(n) for n in re.findall(r"^flashpack_generations_total\{.*\} (\S+)$", text, re.MULTILINE))


def test_echo_with_max_tokens_0_scores_the_prompt_as_a_plain_forward_pass(served):
    engine = served.engine
    ids = engine.tokenizer.encode(PROMPT)
    status, body = post(served, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 3})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    logprobs, expected = choice["logprobs"], reference(engine, ids)
    assert len(logprobs["tokens"]) == len(ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, len(ids)):
        row = expected[position - 1]
        assert close(logprobs["token_logprobs"][position], row[ids[position]].item()), position
        top = sorted(logprobs["top_logprobs"][position].values(), reverse=True)
        best = torch.topk(row, 3).values.tolist()
        assert all(any(close(value, b) for value in top) for b in best), position  # the top 3, and the token
    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
    assert [PROMPT[a:b] for a, b in zip(offsets, offsets[1:] + [len(PROMPT)])] == tokens


def test_a_wrong_position_fails_the_comparison(served):
    """Control: the same check against the row of the position before must fail."""
    engine = served.engine
    ids = engine.tokenizer.encode(PROMPT)
    _, body = post(served, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0})
    reported, expected = body["choices"][0]["logprobs"]["token_logprobs"], reference(engine, ids)
    assert not all(close(reported[p], expected[p - 2][ids[p]].item()) for p in range(2, len(ids)))


def test_lm_eval_request_a_batch_of_token_id_prompts_with_one_generated_token(served):
    """What local-completions sends: it sums token_logprobs[ctxlen:-1], so each choice must hold the
    prompt's entries and then exactly the one generated token's."""
    engine = served.engine
    batch = [engine.tokenizer.encode(PROMPT), engine.tokenizer.encode("import os\nprint(os.getcwd())")]
    status, body = post(served, {"prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1,
                                 "seed": 1234, "echo": True})
    assert status == 200, body
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    for ids, choice in zip(batch, body["choices"]):
        logprobs, expected = choice["logprobs"], reference(engine, ids)
        assert len(logprobs["token_logprobs"]) == len(ids) + 1
        for position in range(1, len(ids)):
            assert close(logprobs["token_logprobs"][position], expected[position - 1][ids[position]].item())
        # greedy: the generated token is the most likely one, and its top entry says so
        assert close(logprobs["token_logprobs"][-1], expected[-1].max().item())
        assert logprobs["token_logprobs"][-1] == max(logprobs["top_logprobs"][-1].values())
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in batch)
    assert body["usage"]["completion_tokens"] == 2


def test_sampled_tokens_report_the_unmodified_models_distribution(served):
    """At temperature 1.7 with top-k, the reported values are still the model's log-softmax at
    temperature 1 over the whole vocabulary (as OpenAI and vLLM report them)."""
    engine = served.engine
    ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=6, temperature=1.7, top_k=20, seed=7)
    events = list(engine.generator.stream(ids, params, logprobs=LogprobRequest(2)))
    generated = [event.token_id for event in events if event.token_id is not None]
    expected = reference(engine, ids + generated)
    for step, event in enumerate(e for e in events if e.token_id is not None):
        row = expected[len(ids) - 1 + step]
        assert close(event.logprob.logprob, row[event.token_id].item())
        assert [t for t, _ in event.logprob.top] == torch.topk(row, 2).indices.tolist()
    status, body = post(served, {"prompt": ids, "max_tokens": 6, "temperature": 1.7, "top_k": 20, "seed": 7,
                                 "logprobs": 2})
    assert status == 200, body
    served_values = body["choices"][0]["logprobs"]["token_logprobs"]
    direct = [e.logprob.logprob for e in events if e.logprob is not None]
    assert len(served_values) == len(direct) and all(close(a, b) for a, b in zip(served_values, direct))


def test_streamed_batch_through_the_openai_client_equals_the_whole_reply(served):
    engine, client = served.engine, served.openai()
    batch = [engine.tokenizer.encode(PROMPT), engine.tokenizer.encode("class A:\n    pass\n")]
    args = {"model": MODEL, "prompt": batch, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    whole = client.completions.create(**args)
    streamed: dict[int, dict[str, list]] = {0: {}, 1: {}}
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs is not None:
                for key in ("tokens", "token_logprobs", "text_offset"):
                    streamed[choice.index].setdefault(key, []).extend(getattr(choice.logprobs, key))
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        for key in ("tokens", "token_logprobs", "text_offset"):
            assert streamed[choice.index][key] == getattr(choice.logprobs, key)


@pytest.mark.parametrize("echo, logprobs, max_tokens", [
    (True, None, 0), (True, None, 2), (False, None, 2), (True, 0, 0), (True, 2, 2), (False, 1, 2)])
def test_every_mix_of_echo_logprobs_and_max_tokens_streamed_or_not(served, echo, logprobs, max_tokens):
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "echo": echo,
            "logprobs": logprobs}
    client = served.openai()
    whole = client.completions.create(**args).choices[0]
    assert whole.text.startswith(PROMPT) == echo
    assert (whole.logprobs is None) == (logprobs is None)
    if logprobs is not None:
        tokens = len(served.engine.tokenizer.encode(PROMPT)) * echo + max_tokens
        assert len(whole.logprobs.token_logprobs) in (tokens, tokens - 1)  # one fewer if a stop token came first
    chunks = [chunk.choices[0] for chunk in client.completions.create(**args, stream=True)]
    assert "".join(chunk.text for chunk in chunks) == whole.text
    if logprobs is not None:
        assert [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs] == whole.logprobs.token_logprobs


def test_a_stop_token_that_ends_the_reply_has_its_entry_but_no_text(tiny_tokenizer):
    engine = scripted_engine(tiny_tokenizer, "hello world")
    with serving(engine, ServerSettings(model_name=MODEL, api_key=KEY)) as served:
        status, body = post(served, {"prompt": "say", "max_tokens": 20, "logprobs": 0})
    assert status == 200, body
    choice = body["choices"][0]
    end = tiny_tokenizer.tokenizer.convert_ids_to_tokens(tiny_tokenizer.stop_token_ids[0])
    assert choice["text"] == "hello world" and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"][-1] == end
    assert "".join(choice["logprobs"]["tokens"][:-1]) == "hello world"
    assert choice["logprobs"]["text_offset"][-1] == len("hello world")


def test_chat_logprobs_through_the_openai_client_streamed_or_not(served):
    engine, client = served.engine, served.openai()
    messages = [{"role": "user", "content": "Write a function."}]
    args = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 3, "extra_body": NO_THINKING}
    reply = client.chat.completions.create(**args)
    content = reply.choices[0].logprobs.content
    prompt_ids = engine.tokenizer.encode_chat(messages, None, False)
    generated = engine.generator.generate(prompt_ids, SamplingParams(max_tokens=6)).token_ids
    expected = reference(engine, prompt_ids + generated)
    assert len(content) == len(generated)
    for step, (entry, token) in enumerate(zip(content, generated)):
        row = expected[len(prompt_ids) - 1 + step]
        assert close(entry.logprob, row[token].item())
        top = torch.topk(row, 3).values.tolist()
        assert len(entry.top_logprobs) == 3  # rounding both to 4 places fails where they straddle a boundary
        assert all(close(t.logprob, v) for t, v in zip(entry.top_logprobs, top)), (entry.top_logprobs, top)
    assert b"".join(bytes(entry.bytes) for entry in content).decode(errors="replace") == reply.choices[0].message.content
    streamed = [entry for chunk in client.chat.completions.create(**args, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=NO_THINKING)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # generates nothing and scores nothing
    ({"prompt": [[1, 2]] * 65, "max_tokens": 1}, "prompt"),  # more prompts than a batch may hold
    ({"prompt": [True, 2]}, "prompt"),
    ({"prompt": [1.0, 2]}, "prompt"),
    ({"prompt": [[1], "x"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]], "max_tokens": 1}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": list(range(600)), "max_tokens": 0, "echo": True}, "messages"),  # past the 512-token context
])
def test_bad_completion_requests_are_400s_naming_the_field(served, body, param):
    status, reply = post(served, body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["param"] == param


def test_a_bad_prompt_in_a_batch_refuses_the_batch_before_any_runs(served):
    before = generations(served)
    status, reply = post(served, {"prompt": [[1, 2, 3], [10**9]], "max_tokens": 1, "echo": True, "logprobs": 1})
    assert status == 400 and reply["error"]["param"] == "prompt"
    assert generations(served) == before
    assert post(served, {"prompt": "ok", "max_tokens": 1})[0] == 200  # still serving


def test_bad_chat_logprobs_requests_are_400s(served):
    client, messages = served.openai(), [{"role": "user", "content": "hi"}]
    for bad in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **bad)
        assert caught.value.body["param"] == "top_logprobs"
