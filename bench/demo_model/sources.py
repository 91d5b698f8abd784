"""The demo model four ways, all in FP32 on the CPU.

    transformers_model(snapshot)     transformers' Qwen4ExpForCausalLM on the snapshot (BF16 upcast)
    pack_weights_model(snapshot)     the same with the weights a pack of it holds: routed experts
                                     NVFP4-rounded, PLE rows FP8-rounded, dense BF16 (what
                                     `flashpack verify` feeds its reference, verify/expected.py)
    pack_engine(pack)                flashpack's engine on the pack (load_engine) and its MTP head
    snapshot_engine(snapshot)        flashpack's engine on the snapshot's own BF16 weights: the same
                                     weights as transformers_model, so engine against transformers

A pack's experts are always NVFP4, so the pack against transformers_model measures quantisation;
the other two pairs (same weights) measure the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen4ExpForCausalLM

from flashpack.convert.nvfp4 import quantize_fp8_rows
from flashpack.convert.source import SourceCheckpoint
from flashpack.layout.model_config import TextConfig
from flashpack.layout.nvfp4 import dequantize_fp8_rows
from flashpack.layout.pack import Pack
from flashpack.runtime.experts import ExpertWeights
from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.model import MTPHead, Qwen4ExpModel
from flashpack.runtime.pack_source import PackExperts, PackWeights
from flashpack.verify.expected import ExpectedWeights


@dataclass
class Engine:
    """flashpack's engine model and the MTP head that drafts from its streams."""

    model: Qwen4ExpModel
    mtp: MTPHead


def transformers_model(snapshot: Path) -> Qwen4ExpForCausalLM:
    """The snapshot in transformers, FP32, greedy by default, generating to the token budget (no
    eos stop, so every prompt yields the same number of tokens as the engine's loop)."""
    model = Qwen4ExpForCausalLM.from_pretrained(snapshot, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig(do_sample=False, pad_token_id=model.config.eos_token_id)
    return model


@torch.no_grad()
def pack_weights_model(snapshot: Path) -> Qwen4ExpForCausalLM:
    """transformers_model with each routed expert and PLE table rounded as the pack stores them."""
    model = transformers_model(snapshot)
    expected = ExpectedWeights(SourceCheckpoint.open(snapshot), dense_fp8_rows=False)
    for index, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for expert in range(experts.gate_up_proj.shape[0]):
            rounded = expected.expert(index, expert)
            experts.gate_up_proj[expert] = torch.cat([rounded.gate, rounded.up])
            experts.down_proj[expert] = rounded.down
        if layer.ple is not None:
            table = layer.ple.ple_embedding.ngram_embedding.weight
            # FP8 rows with a float32 scale each: rounding the whole table equals rounding row by row.
            table.copy_(dequantize_fp8_rows(*quantize_fp8_rows(table)))
    return model


def pack_engine(pack_path: Path) -> Engine:
    """The engine as `flashpack run` loads it on a CPU (experts decoded from the pack), FP32."""
    loaded = load_engine(pack_path, EngineConfig(dtype="float32", cuda_graphs=False))
    pack = Pack.open(pack_path)
    return Engine(loaded.model, MTPHead(loaded.model, PackWeights(pack), PackExperts(pack)))


def snapshot_engine(snapshot: Path) -> Engine:
    checkpoint = SourceCheckpoint.open(snapshot)
    weights, experts = SnapshotWeights(checkpoint), SnapshotExperts(checkpoint)
    model = Qwen4ExpModel(weights, experts, dtype=torch.float32, device="cpu")
    return Engine(model, MTPHead(model, weights, experts))


class SnapshotWeights:
    """The engine's WeightSource over a snapshot's tensors as stored (no pack rounding)."""

    def __init__(self, checkpoint: SourceCheckpoint):
        self.checkpoint = checkpoint
        self.config: TextConfig = checkpoint.config
        self._ple_tables: dict[int, torch.Tensor] = {}

    def dense(self, name: str) -> torch.Tensor:
        return self.checkpoint.tensor(name)

    def ple_rows(self, ple_index: int, rows: torch.Tensor) -> torch.Tensor:
        table = self._ple_tables.get(ple_index)
        if table is None:
            layer = self.config.ple_layer_ids[ple_index] - 1
            prefix = f"layers.{layer}.ple.ple_embedding.ngram_embedding"
            shards = [self.checkpoint.tensor(f"{prefix}.shard_{shard}.weight")
                      for shard in range(self.config.split_ngram_parts)]
            table = self._ple_tables[ple_index] = torch.cat(shards)
        return table[rows]


class SnapshotExperts:
    """The engine's ExpertFetcher over a snapshot's BF16 experts (decoder layers and the MTP layer)."""

    def __init__(self, checkpoint: SourceCheckpoint):
        self.checkpoint = checkpoint
        self._cache: dict[tuple[int, int], ExpertWeights] = {}

    def fetch(self, layer: int, experts: list[int]) -> dict[int, ExpertWeights]:
        return {expert: self._expert(layer, expert) for expert in experts}

    def _expert(self, layer: int, expert: int) -> ExpertWeights:
        weights = self._cache.get((layer, expert))
        if weights is None:
            layers = self.checkpoint.config.num_hidden_layers
            owner = f"layers.{layer}." if layer < layers else f"mtp.layers.{layer - layers}."
            prefix = f"{owner}mlp.experts.{expert}."
            weights = ExpertWeights(*(self.checkpoint.tensor(f"{prefix}{part}_proj.weight")
                                      for part in ("gate", "up", "down")))
            self._cache[layer, expert] = weights
        return weights
