"""The server's log-probabilities of a prompt against transformers' own Qwen4ExpForCausalLM, on the
trained demo model.

transformers is given the weights the pack should hold, derived from the snapshot alone
(verify/expected.py: dense tensors BF16-rounded, experts NVFP4-rounded, PLE rows FP8-rounded), and
runs the prompt in one ordinary forward pass in float32; the server runs the pack.
"""

from __future__ import annotations

import json

import pytest
import torch
from server_harness import serving
from transformers import Qwen4ExpForCausalLM

from flashpack import demo_model
from flashpack.convert.source import SourceCheckpoint
from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.server import ServerSettings
from flashpack.verify.expected import ExpectedWeights
from tests.transformers_model import full_model

PROMPT = "def forward(self, hidden_states):\n    hidden_states = self.dense(hidden_states)\n    return"


@pytest.fixture(scope="module")
def demo_engine(demo_pack):
    return load_engine(demo_pack, EngineConfig(store=StoreConfig(verify_records=False)))


def _transformers_model() -> Qwen4ExpForCausalLM:
    return full_model(ExpectedWeights(SourceCheckpoint.open(demo_model.snapshot_path()), dense_fp8_rows=False))


def test_prompt_logprobs_equal_transformers_own_model(demo_engine):
    ids = demo_engine.tokenizer.encode(PROMPT)
    with serving(demo_engine, ServerSettings(model_name="demo")) as served:
        status, body = served.raw("POST", "/v1/completions", json.dumps(
            {"model": "demo", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}).encode(),
            {"content-type": "application/json"})
    assert status == 200, body
    reported = torch.tensor(body["choices"][0]["logprobs"]["token_logprobs"][1:])
    with torch.no_grad():
        logits = _transformers_model()(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(reported, expected, rtol=1e-5, atol=1e-5)
    assert reported.mean() > -3.0  # a trained model: the code is likely, unlike a random one's ~-8.7
    shifted = torch.log_softmax(logits, dim=-1)[1:].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert not torch.allclose(reported, shifted, rtol=1e-5, atol=1e-5)  # control: a position off fails
