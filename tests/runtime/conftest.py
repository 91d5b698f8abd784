"""Fixtures for the engine tests: one tiny reference model per session and engines built from it."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from reference_model import (  # noqa: E402
    StateDictExperts, StateDictWeights, build_reference, mtp_tensors, text_config,
)

from flashpack.runtime.model import MTPHead, Qwen4ExpModel  # noqa: E402


@dataclass
class Bench:
    reference: torch.nn.Module  # transformers Qwen4ExpForCausalLM, fp32
    weights: StateDictWeights
    experts: StateDictExperts
    mtp_weights: dict[str, torch.Tensor]

    def engine(self, dtype: torch.dtype = torch.float32, weights=None, experts=None) -> Qwen4ExpModel:
        return Qwen4ExpModel(weights or self.weights, experts or self.experts, dtype=dtype, device="cpu")

    def mtp(self, engine: Qwen4ExpModel) -> MTPHead:
        return MTPHead(engine, self.weights, self.experts)



@pytest.fixture(scope="session")
def bench() -> Bench:
    reference = build_reference(seed=0)
    mtp = mtp_tensors(text_config(reference), seed=0)
    return Bench(reference, StateDictWeights(reference, mtp), StateDictExperts(reference, mtp), mtp)


@pytest.fixture(scope="session")
def engine(bench) -> Qwen4ExpModel:
    return bench.engine()

