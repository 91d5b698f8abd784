"""The reference: transformers' own qwen4_exp text layers, built and run one decoder layer at a time.

A real model never has to fit in memory: each `Qwen4ExpTextDecoderLayer` is constructed on the meta
device, given its dense tensors from `ExpectedWeights`, run over every input sequence, and freed
before the next one. The token sequences are fixed (prefill, then teacher-forced decode), so the
run is layer-major: for each layer, each sequence's prefill chunk and then its decode tokens, one
at a time, go through that layer with a fresh transformers cache, exactly as the full model's
forward would feed them (same rotary positions, causal mask and cache calls).

The gated delta rule runs as transformers' own PyTorch code (`plain_delta_rule`) even where
flash-linear-attention is installed and transformers would call it: the oracle stays independent of
the kernels our engine calls on a GPU, and builds no Triton kernels (fla autotunes every new shape,
which took a float32 verify past three minutes on an H200).

Two parts of the layer are fed lazily, which is mathematically identical to loading them whole:
- routed experts: a forward pre-hook on `mlp.experts` loads only the experts the router picked and
  renumbers them in ascending order, so transformers accumulates them in the same order;
- the PLE table: `ngram_embedding` is replaced by a gather of the looked-up rows; transformers'
  own n-gram hashing still computes the row ids.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from transformers import DynamicCache, Qwen4ExpTextConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

from flashpack.verify.expected import ExpectedWeights
from flashpack.verify.inputs import Sequence

LayerCallback = Callable[[int, list[torch.Tensor]], None]


def transformers_config(raw_text_config: dict) -> Qwen4ExpTextConfig:
    config = Qwen4ExpTextConfig.from_dict(raw_text_config)
    config._attn_implementation = "eager"  # the plain math: matmul, additive mask, softmax
    config._experts_implementation = "eager"
    return config


DELTA_RULE_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


@contextmanager
def plain_delta_rule() -> Iterator[None]:
    """While inside, transformers' qwen4_exp calls its PyTorch delta rule, not the kernel its
    hub-kernel decorator bound at import (the layer's forward looks the names up in the module)."""
    bound = {name: getattr(hf, name) for name in DELTA_RULE_FUNCTIONS}
    for name, function in bound.items():
        setattr(hf, name, inspect.unwrap(function))
    try:
        yield
    finally:
        for name, function in bound.items():
            setattr(hf, name, function)


class LayerwiseReference:
    def __init__(self, weights: ExpectedWeights, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.weights, self.dtype, self.device = weights, dtype, torch.device(device)
        self.hf_config = transformers_config(weights.config.raw)
        self.rotary = hf.Qwen4ExpTextRotaryEmbedding(self.hf_config).to(self.device)

    @torch.inference_mode()
    def run(
        self, sequences: list[Sequence], on_layer: LayerCallback | None = None, progress: bool = False,
    ) -> list[torch.Tensor]:
        """Logits [T, vocab] (float32, CPU) per sequence; `on_layer(layer, outputs)` gets each
        decoder layer's hc streams [T, hc * H] per sequence (T = prefill + decode tokens);
        `progress`: a bar over the layers."""
        with plain_delta_rule():
            return self._run(sequences, on_layer, progress)

    def _run(self, sequences: list[Sequence], on_layer: LayerCallback | None, progress: bool) -> list[torch.Tensor]:
        embed = self._dense("embed_tokens.weight")
        hc = self.hf_config.hc_count
        streams = [[F.embedding(self._ids(step), embed).repeat(1, 1, hc) for step in seq.steps] for seq in sequences]
        del embed
        layers = range(self.hf_config.num_hidden_layers)
        for layer in tqdm(layers, unit="layer", desc=f"reference ({str(self.dtype).removeprefix('torch.')})", disable=not progress):
            module = self._build_layer(layer)
            for seq, chunks in zip(sequences, streams):
                cache, start = DynamicCache(config=self.hf_config), 0
                for index, step in enumerate(seq.steps):
                    chunks[index] = self._layer_step(module, layer, chunks[index], step, start, cache)
                    start += len(step)
            del module
            if on_layer is not None:
                on_layer(layer, [torch.cat(chunks, dim=1)[0].float().cpu() for chunks in streams])
        return self._logits(streams)

    def _layer_step(
        self, module: nn.Module, layer: int, hidden: torch.Tensor, step: list[int], start: int, cache: DynamicCache,
    ) -> torch.Tensor:
        """hidden [1, t, hc * H] of tokens `step` at positions start.. -> layer output, same shape."""
        end = start + len(step)
        # The indexer scores blocks of every visible token, so the rotary table covers all positions.
        positions = torch.arange(end, device=self.device).view(1, 1, -1).expand(3, 1, -1)
        mask = None
        if self.hf_config.layer_types[layer] != "linear_attention":
            mask = create_causal_mask(
                config=self.hf_config, inputs_embeds=hidden, attention_mask=None, past_key_values=cache,
                position_ids=torch.arange(start, end, device=self.device)[None], layer_idx=layer,
                allow_is_causal_skip=False,
            )
        return module(
            hidden, position_embeddings=self.rotary(hidden, positions), attention_mask=mask, conv_mask=None,
            past_key_values=cache, ple_input_ids=self._ids(step),
        )

    def _build_layer(self, layer: int) -> nn.Module:
        with torch.device("meta"):
            module = hf.Qwen4ExpTextDecoderLayer(self.hf_config, layer).eval()
        lazy = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "ple.ple_embedding.ngram_embedding.weight")
        state = {}
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name in lazy:
                continue
            canonical = f"layers.{layer}.{name}"
            state[name] = (
                self._dense(canonical) if tensor.is_floating_point() else self.weights.buffer(canonical).to(self.device)
            )
        module.load_state_dict(state, strict=False, assign=True)
        module.mlp.experts.register_forward_pre_hook(_ExpertLoader(self, layer))
        if module.ple is not None:
            ple_index = self.weights.config.ple_index(layer)
            module.ple.ple_embedding.ngram_embedding = _RowGather(self, ple_index)
        return module

    def _logits(self, streams: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Final mixer and lm_head per forward call (chunk), as the full model applies them."""
        with torch.device("meta"):
            mixer = hf.Qwen4ExpTextGatedResidual(self.hf_config, use_combine=False)
        mixer.load_state_dict(
            {name: self._dense(f"hyper_connection_mixer.{name}") for name, _ in mixer.named_parameters()},
            assign=True,
        )
        head = self._dense("embed_tokens.weight" if self.hf_config.tie_word_embeddings else "lm_head.weight")
        return [torch.cat([F.linear(mixer(chunk), head)[0].float().cpu() for chunk in chunks]) for chunks in streams]

    def _dense(self, name: str) -> torch.Tensor:
        return self.weights.dense(name).to(device=self.device, dtype=self.dtype)

    def _ids(self, step: list[int]) -> torch.Tensor:
        return torch.tensor([step], dtype=torch.long, device=self.device)


class _ExpertLoader:
    """Pre-hook on `Qwen4ExpTextExperts`: give it the routed experts it is about to use.

    The picked experts (ascending) become experts 0..n-1 of a compact stack and the router's ids are
    renumbered to match; transformers loops over hit experts in ascending order, so the arithmetic
    is the same as with all experts present. Dequantised experts are kept for the layer's lifetime.
    """

    def __init__(self, reference: LayerwiseReference, layer: int):
        self.reference, self.layer = reference, layer
        self.loaded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        hidden, top_k_index, top_k_weights = args
        picked = torch.unique(top_k_index).tolist()
        for expert in picked:
            if expert not in self.loaded:
                w = self.reference.weights.expert(self.layer, expert, self.reference.device)
                dtype = self.reference.dtype
                self.loaded[expert] = (torch.cat([w.gate, w.up]).to(dtype), w.down.to(dtype))
        renumber = torch.full((module.config.num_experts,), -1, dtype=top_k_index.dtype, device=top_k_index.device)
        renumber[picked] = torch.arange(len(picked), dtype=top_k_index.dtype, device=top_k_index.device)
        module.num_experts = len(picked)
        module.gate_up_proj = nn.Parameter(torch.stack([self.loaded[e][0] for e in picked]), requires_grad=False)
        module.down_proj = nn.Parameter(torch.stack([self.loaded[e][1] for e in picked]), requires_grad=False)
        return hidden, renumber[top_k_index], top_k_weights


class _RowGather(nn.Module):
    """Stands in for `ngram_embedding` (an nn.Embedding too large to load): reads the looked-up rows."""

    def __init__(self, reference: LayerwiseReference, ple_index: int):
        super().__init__()
        self.reference, self.ple_index = reference, ple_index
        cfg = reference.weights.config
        # transformers places the lookup on weight.device unless it is meta; meta costs no memory.
        self.register_buffer("weight", torch.empty(cfg.ple_table_rows(ple_index), cfg.ple_head_dim, device="meta"),
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 [..., heads] row ids -> [..., heads, ple_head_dim] rows."""
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        rows = self.reference.weights.ple_rows(self.ple_index, unique.cpu())
        rows = rows.to(device=self.reference.device, dtype=self.reference.dtype)
        return rows[inverse.to(rows.device)].reshape(*ids.shape, -1)
