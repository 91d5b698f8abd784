"""lm-eval 0.4.13, unchanged, against a real `flashpack serve` of the trained demo model.

lm-eval runs as a library (`simple_evaluate`, `local-completions` with its default token-id
prompts) on our two tasks over their first documents; its scores must equal what flashpack's model
gives by a plain forward pass over the same tokens, to 1e-4. The runner `python -m flashpack.evals`
is run too, and a chat request asks for logprobs through the official openai client.
"""

from __future__ import annotations

import json
import math
import re

import lm_eval
import pytest
import torch
from click.testing import CliRunner
from lm_eval.tasks import TaskManager
from server_harness import serving

from flashpack.evals import TASKS_DIR
from flashpack.evals.__main__ import main as evals_main
from flashpack.evals.dataset import code_documents, held_out_files, next_line_items
from flashpack.runtime.server import ServerSettings

CODE_DOCUMENTS = 3
NEXT_LINE_ITEMS = 16
FILES = 4  # enough held-out files for both


@pytest.fixture(scope="module")
def served(demo_engine):
    with serving(demo_engine, ServerSettings(model_name="demo")) as served:
        yield served


def _sequence_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """Each token's log-probability given those before it (ids[1:]), by one plain forward pass."""
    state = engine.model.new_state()
    state.reserve(len(ids) + 1)
    logp = torch.log_softmax(engine.model.forward(torch.tensor(ids), state).logits.float(), dim=-1)
    return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].double()


def _continuation_loglikelihood(engine, context: str, continuation: str) -> float:
    """As lm-eval scores a choice: trailing whitespace of the context moves to the continuation,
    the pair is encoded whole, and the continuation is what follows as many tokens as the context
    has on its own, after the context's own tokens (where a token merges across the cut, that is
    not the whole's tokenization: our items cut where none does, test_next_line_items_cut_cleanly)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = engine.tokenizer.encode(context + continuation)
    context_ids = engine.tokenizer.encode(context)
    sequence = context_ids + whole[len(context_ids) :]
    return float(_sequence_logprobs(engine, sequence)[len(context_ids) - 1 :].sum())


def test_lm_eval_scores_equal_the_engines_own_logprobs(served, demo_engine, demo_pack):
    eos = demo_engine.model.config.eos_token_id
    args = (f"base_url={served.base_url}/v1/completions,model=demo,tokenizer_backend=huggingface,"
            f"tokenizer={demo_pack / 'tokenizer'},tokenized_requests=True,num_concurrent=1,max_retries=1,"
            f"custom_prefix_token_id={eos},batch_size=4")
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"max_files": FILES})
    results = lm_eval.simple_evaluate(model="local-completions", model_args=args, task_manager=manager,
                                      tasks=["flashpack_heldout_code"], limit=CODE_DOCUMENTS)["results"]
    code = results["flashpack_heldout_code"]
    results = lm_eval.simple_evaluate(model="local-completions", model_args=args, task_manager=manager,
                                      tasks=["flashpack_next_line"], limit=NEXT_LINE_ITEMS)["results"]
    next_line = results["flashpack_next_line"]
    files = held_out_files(FILES)

    documents = code_documents(files)[:CODE_DOCUMENTS]
    loglikelihood = sum(float(_sequence_logprobs(demo_engine, [eos] + demo_engine.tokenizer.encode(d["text"])).sum())
                        for d in documents)
    size = sum(len(d["text"].encode()) for d in documents)
    words = sum(len(re.split(r"\s+", d["text"])) for d in documents)  # the task's own count (as wikitext's)
    assert math.isfinite(code["bits_per_byte,none"])
    assert code["bits_per_byte,none"] == pytest.approx(-loglikelihood / size / math.log(2), rel=1e-4)
    assert code["byte_perplexity,none"] == pytest.approx(math.exp(-loglikelihood / size), rel=1e-4)
    assert code["word_perplexity,none"] == pytest.approx(math.exp(-loglikelihood / words), rel=1e-4)

    items = next_line_items(files)[:NEXT_LINE_ITEMS]
    right = right_normed = 0
    for item in items:
        scores = [_continuation_loglikelihood(demo_engine, item.context, choice) for choice in item.choices]
        right += max(range(len(scores)), key=scores.__getitem__) == item.gold
        normed = [score / len(choice) for score, choice in zip(scores, item.choices)]
        right_normed += max(range(len(normed)), key=normed.__getitem__) == item.gold
    assert next_line["acc,none"] == pytest.approx(right / len(items), abs=1e-9)
    assert next_line["acc_norm,none"] == pytest.approx(right_normed / len(items), abs=1e-9)
    assert next_line["acc,none"] > 0.5  # the true line wins most of the time (chance: 0.25)


def test_the_runner_prints_the_table_and_the_held_out_loss_beside_it(served, demo_pack, tmp_path):
    out = tmp_path / "results.json"
    result = CliRunner().invoke(evals_main, [served.base_url, str(demo_pack), "--limit", "2", "--max-files", "1",
                                             "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "flashpack_next_line" in result.output and "bits/byte; the training record's held-out loss" in result.output
    assert set(json.loads(out.read_text())) == {"flashpack_heldout_code", "flashpack_next_line"}


def test_the_runner_refuses_in_one_line(served, demo_pack, tmp_path):
    for args in ([served.base_url, str(tmp_path)], [served.base_url, str(demo_pack), "--tasks", "mmlu"],
                 ["http://127.0.0.1:9", str(demo_pack)]):
        result = CliRunner().invoke(evals_main, args)
        assert result.exit_code == 2 and result.output.startswith("error: "), result.output
        assert len(result.output.strip().splitlines()) == 1


def test_chat_logprobs_through_the_openai_client(served):
    reply = served.openai(api_key="unused").chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens  # the end-of-turn token has no entry
    for entry in content:
        assert math.isfinite(entry.logprob) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
