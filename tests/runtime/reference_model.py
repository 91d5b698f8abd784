"""A tiny random transformers qwen4_exp with every feature on, and in-memory engine sources for it.

Test helpers only (never imported by the runtime): `tiny_config` builds a Qwen4ExpTextConfig with
8 layers (3 DeltaNet + 1 QSA, twice), PLE on layer 2 (one-indexed), an indexer budget of 16 tokens
in blocks of 4, 16 experts top-4 and 4 hc streams; `build_reference` makes the model and perturbs
every parameter (transformers starts zero-centred norms at 0 and the PLE conv at 0, which would hide
w-vs-(1+w) bugs); `StateDictWeights` / `StateDictExperts` serve it to the engine, with random MTP
weights added by name from the checkpoint spec.
"""

from __future__ import annotations

import math

import torch
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

from flashpack.layout.checkpoint_spec import iter_specs
from flashpack.layout.model_config import TextConfig
from flashpack.runtime.experts import ExpertWeights

EOS = 5


def tiny_config(**overrides) -> Qwen4ExpTextConfig:
    values = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=16, num_experts_per_tok=4, hc_count=4, hc_lowrank=16, ple_layer_ids=[2],
        ple_embed_dim=64, heads_per_ngram=2, ngram_vocab_size_base=499, indexer_n_heads=8,
        indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=16, indexer_compress_ratio=4,
        eos_token_id=EOS, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [3, 3, 2]},
    )
    values.update(overrides)
    return Qwen4ExpTextConfig(**values)


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter a random, non-trivial value with activations of order one."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if name.endswith("linear_attn.norm.weight"):  # RMSNormGated: plain weight around 1
            param.copy_(1 + 0.3 * noise)
        elif "norm" in name:  # zero-centred: applied as 1 + w
            param.copy_(0.3 * noise)
        elif name.endswith("A_log"):
            param.copy_(torch.empty(param.shape).uniform_(0.1, 2.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            param.copy_(0.5 * noise)
        elif "conv1d" in name:
            param.copy_(0.4 * noise)
        elif "embed" in name:  # token and n-gram tables
            param.copy_(noise)
        else:  # [out, in] or [E, out, in] projections
            param.copy_(noise / math.sqrt(param.shape[-1]))


def build_reference(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Qwen4ExpForCausalLM:
    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(tiny_config(**overrides))
    perturb(model, seed)
    return model.to(dtype).eval()


def text_config(model: Qwen4ExpForCausalLM) -> TextConfig:
    return TextConfig.from_text_dict(model.config.to_dict())


def mtp_tensors(cfg: TextConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random MTP weights named and shaped by the checkpoint spec (transformers has no MTP)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    tensors = {}
    for spec in iter_specs(cfg, with_mtp=True):
        if not spec.name.startswith("mtp."):
            continue
        noise = torch.randn(spec.shape, generator=gen)
        tensors[spec.name] = 0.3 * noise if "norm" in spec.name else noise / math.sqrt(spec.shape[-1])
    return tensors


class StateDictWeights:
    """WeightSource over a transformers state_dict (+ MTP tensors); PLE rows gathered per call."""

    def __init__(self, model: Qwen4ExpForCausalLM, mtp: dict[str, torch.Tensor] | None = None):
        self.config = text_config(model)
        self.tensors = {}
        for key, tensor in model.state_dict().items():
            name = key.removeprefix("model.")
            if ".mlp.experts." not in name:
                self.tensors[name] = tensor.detach().clone()
        self.tensors.update({k: v for k, v in (mtp or {}).items() if ".mlp.experts." not in k})
        self.rows_served = 0

    def dense(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def ple_rows(self, ple_index: int, rows: torch.Tensor) -> torch.Tensor:
        layer = self.config.ple_layer_ids[ple_index] - 1
        table = self.tensors[f"layers.{layer}.ple.ple_embedding.ngram_embedding.weight"]
        self.rows_served += rows.numel()
        return table[rows]


class StateDictExperts:
    """ExpertFetcher that un-fuses transformers' gate_up_proj [E, 2I, H] / down_proj [E, H, I]."""

    def __init__(self, model: Qwen4ExpForCausalLM, mtp: dict[str, torch.Tensor] | None = None):
        cfg = text_config(model)
        self.experts: dict[tuple[int, int], ExpertWeights] = {}
        inter = cfg.moe_intermediate_size
        for layer in range(cfg.num_hidden_layers):
            block = model.model.layers[layer].mlp.experts
            for e in range(cfg.num_experts):
                gate_up = block.gate_up_proj[e].detach().clone()
                down = block.down_proj[e].detach().clone()
                self.experts[layer, e] = ExpertWeights(gate_up[:inter], gate_up[inter:], down)
        for j in range(cfg.mtp_num_hidden_layers if mtp else 0):
            for e in range(cfg.num_experts):
                part = lambda p: mtp[f"mtp.layers.{j}.mlp.experts.{e}.{p}.weight"]  # noqa: E731
                self.experts[cfg.num_hidden_layers + j, e] = ExpertWeights(
                    part("gate_proj"), part("up_proj"), part("down_proj"),
                )
        self.calls: list[tuple[int, list[int]]] = []

    def fetch(self, layer: int, experts: list[int]) -> dict[int, ExpertWeights]:
        self.calls.append((layer, list(experts)))
        return {e: self.experts[layer, e] for e in experts}


class SwappedExperts:
    """Control: serves expert e ^ 1's weights for expert e in one layer (experts 0<->1, 2<->3, ...)."""

    def __init__(self, inner, layer: int):
        self.inner, self.layer = inner, layer

    def fetch(self, layer, experts):
        if layer != self.layer:
            return self.inner.fetch(layer, experts)
        partners = self.inner.fetch(layer, sorted(e ^ 1 for e in experts))
        return {e: partners[e ^ 1] for e in experts}


def prompts() -> dict[str, list[int]]:
    """Token prompts: short, with EOS inside (PLE document boundaries), and longer than the budget."""
    gen = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(6, 256, (n,), generator=gen).tolist()  # noqa: E731
    long_eos = rand(30) + [EOS] + rand(20) + [EOS, EOS] + rand(19)
    return {
        "short": rand(9),
        "eos_inside": rand(5) + [EOS] + rand(1) + [EOS] + rand(6),
        "starts_with_eos": [EOS] + rand(12),
        "long_44": rand(44),
        "long_72_eos": long_eos,
    }


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()
