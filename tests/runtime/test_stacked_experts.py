"""StackedExperts (every expert of a small layer at once, for a few tokens) against the plain
expert loop it stands in for, DequantisedExperts, on random experts and routings; float32,
tolerance 1e-5 relative (the two sum the picked experts in other orders)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashpack.runtime.engine import expert_paths
from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.expert_paths import STACKED_MAX_TOKENS, StackedExperts
from flashpack.runtime.experts import ExpertWeights
from flashpack.runtime.model.routed_experts import DequantisedExperts

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 8, 3, 32, 16


class RandomExperts:
    """An ExpertFetcher of random experts, counting what it is asked for."""

    def __init__(self, layers: int = 2, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        rand = lambda *shape: torch.randn(*shape, generator=gen) * 0.2  # noqa: E731
        self.weights = {(layer, e): ExpertWeights(rand(INTERMEDIATE, HIDDEN), rand(INTERMEDIATE, HIDDEN),
                                                  rand(HIDDEN, INTERMEDIATE))
                        for layer in range(layers) for e in range(EXPERTS)}
        self.fetches = 0

    def fetch(self, layer: int, experts: list[int]) -> dict[int, ExpertWeights]:
        self.fetches += 1
        return {e: self.weights[layer, e] for e in experts}


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    weights, experts = torch.randn(tokens, EXPERTS, generator=gen).softmax(-1).topk(TOP_K, dim=-1)
    return x, weights, experts


def _both(fetcher) -> tuple[StackedExperts, DequantisedExperts]:
    stacked = StackedExperts(fetcher, F.silu, torch.float32, "cpu", EXPERTS)
    return stacked, DequantisedExperts(fetcher, F.silu, torch.float32, "cpu")


@pytest.mark.parametrize("tokens", [1, 2, 5, STACKED_MAX_TOKENS])
def test_a_few_tokens_give_the_expert_loops_output(tokens):
    stacked, loop = _both(RandomExperts())
    for layer in (0, 1):
        x, weights, experts = _routing(tokens, seed=tokens + layer)
        torch.testing.assert_close(stacked(layer, x, weights, experts), loop(layer, x, weights, experts),
                                   rtol=1e-5, atol=1e-6)


def test_a_layer_is_stacked_once_and_more_tokens_take_the_loop():
    fetcher = RandomExperts()
    stacked, loop = _both(fetcher)
    for seed in range(3):
        stacked(0, *_routing(4, seed))
    assert fetcher.fetches == 1
    x, weights, experts = _routing(STACKED_MAX_TOKENS + 1, seed=9)
    assert torch.equal(stacked(0, x, weights, experts), loop(0, x, weights, experts))  # the loop itself


def test_control_another_routing_gives_another_output():
    """The comparison tells experts apart: the same picks with experts 0<->1, 2<->3, ... swapped differ."""
    stacked, loop = _both(RandomExperts())
    x, weights, experts = _routing(5, seed=3)
    assert not torch.allclose(stacked(0, x, weights, experts ^ 1), loop(0, x, weights, experts), rtol=1e-3, atol=1e-4)


def test_the_engine_stacks_small_layers_only(tiny_pack, monkeypatch):
    config = EngineConfig(dtype="float32", prompt_cache_ram=0, speculate="off")
    assert isinstance(load_engine(tiny_pack, config).model.experts, StackedExperts)
    monkeypatch.setattr(expert_paths, "STACKED_EXPERTS_MAX_PARAMS", 0)
    assert type(load_engine(tiny_pack, config).model.experts) is DequantisedExperts
