"""The qwen4_exp text model as one step function: tokens of one sequence in, logits out.

    embed -> repeat into hc streams -> decoder layers -> final mixer -> lm_head

`forward(tokens, state)` takes any number of new tokens of one sequence: a whole prompt (prefill),
one token (decode), or a few (speculative verification); the state carries everything needed to
continue. It also returns the pre-final-mixer streams, which the MTP head consumes.

Routed experts come through one injected `RoutedExperts` (runtime/model/routed_experts.py); an
`ExpertFetcher` given instead runs as the plain `DequantisedExperts`. The kernel choices are fixed
at construction: `fused_mix` (one-token hyper-connection mixes as two Triton kernels each, CUDA
only), `dense_matvec_max_tokens` and `dense_tile_max_tokens` (BF16 projections of up to that many
tokens take the matvec kernel on CUDA, then the tile kernel's few-token tiles, more cuBLAS;
dense_linear says which matrices), `fp8_matvec_max_tokens` (FP8 projections: the matvec kernel, more the tile kernel) and
`delta_rule_recurrent_max_tokens` (DeltaNet steps of up to that many tokens by the recurrence) and
`compile_pieces` (the plain tensor code between the layers' kernels of their own compiled by
torch.compile, one compile for every layer and step length: compiled.py) and `fused_norms` (the
RMS norms of steps run outside a compile as one Triton kernel each, CUDA only: norms.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flashpack.runtime.experts import ExpertFetcher
from flashpack.runtime.kernels.dispatch import DENSE_MATVEC_MAX_TOKENS, DENSE_TILE_MAX_TOKENS, FP8_MATVEC_MAX_TOKENS
from flashpack.runtime.model.decoder_layer import DecoderLayer
from flashpack.runtime.model.deltanet import GatedDeltaNet
from flashpack.runtime.model.hyper_connection import GatedResidual
from flashpack.runtime.model.qsa_attention import QSAAttention
from flashpack.runtime.model.linear import StackedLinear
from flashpack.runtime.model.norms import RMSNorm
from flashpack.runtime.model.routed_experts import RoutedExperts, as_routed_experts
from flashpack.runtime.model.rope import Rotary
from flashpack.runtime.state import SequenceState
from flashpack.runtime.weights import WeightSource, load_dense


@dataclass
class StepOutput:
    logits: torch.Tensor  # [T, vocab] (or [1, vocab] with last_only), engine dtype
    streams: torch.Tensor  # [T, hc * H] pre-final-mixer hidden streams: the MTP head's input
    marked: list[SequenceState] | None = None  # the sequence's state after each of `marks` (forward)


class Qwen4ExpModel(nn.Module):
    def __init__(
        self, source: WeightSource, experts: RoutedExperts | ExpertFetcher, dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu", fused_mix: bool = False,
        dense_matvec_max_tokens: int = DENSE_MATVEC_MAX_TOKENS, dense_tile_max_tokens: int = DENSE_TILE_MAX_TOKENS,
        fp8_matvec_max_tokens: int = FP8_MATVEC_MAX_TOKENS, delta_rule_recurrent_max_tokens: int = 1,
        compile_pieces: bool = False, fused_norms: bool = False,
    ):
        super().__init__()
        cfg = self.config = source.config
        self.dtype, self.device = dtype, torch.device(device)
        if (fused_mix or fused_norms) and self.device.type != "cuda":
            raise ValueError("fused hyper-connection mixes and norms run on CUDA only")
        self.experts = experts = as_routed_experts(experts, cfg, dtype, self.device)
        self.rotary = Rotary(cfg, self.device)
        self.register_buffer("embed_tokens", load_dense(source, "embed_tokens.weight", dtype, device), persistent=False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, source, experts, layer, f"layers.{layer}.", self.rotary, dtype, device)
            for layer in range(cfg.num_hidden_layers)
        )
        self.final_mixer = GatedResidual(cfg, source, "hyper_connection_mixer.", dtype, device, inject=False)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.register_buffer("lm_head", load_dense(source, "lm_head.weight", dtype, device), persistent=False)
        self.fused_mix, self.dense_matvec_max_tokens = fused_mix, dense_matvec_max_tokens
        for module in self.modules():
            if isinstance(module, GatedResidual):
                module.fused = fused_mix
            if isinstance(module, RMSNorm):
                module.use_kernel = fused_norms
            if isinstance(module, StackedLinear):
                module.matvec_max_tokens, module.fp8_matvec_max_tokens = dense_matvec_max_tokens, fp8_matvec_max_tokens
                module.tile_max_tokens = dense_tile_max_tokens
            if isinstance(module, GatedDeltaNet):
                module.recurrent_max_tokens = delta_rule_recurrent_max_tokens
            if isinstance(module, (DecoderLayer, GatedDeltaNet, QSAAttention)):
                module.compile_pieces = compile_pieces

    def observe_routing(self, observer: Callable[[int, torch.Tensor], None] | None) -> None:
        """Call `observer(layer, expert ids [T, k])` with every MoE block's routing, as the layers
        run (a step replayed from CUDA graphs runs none of this code: observe without them)."""
        for layer in self.layers:
            layer.moe.routing_observer = observer

    def new_state(self) -> SequenceState:
        return SequenceState.empty(self.config, self.dtype, self.device)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, state: SequenceState, last_only: bool = False,
                depth: int | None = None, marks: Sequence[int] = ()) -> StepOutput:
        """tokens int64 [T] (the next T tokens of the sequence) -> StepOutput; advances `state` by T.
        `depth`: run only the first `depth` decoder layers (a warm-up builds every kernel a prompt
        needs from one layer of each kind; the state is then good for nothing else). `marks`: token
        counts within the T after which the state is also wanted (prompt-state checkpoints), as if
        the tokens had run in steps ending there, in one pass over the layers: a step through a
        tiered store fetches each layer's experts once, not once a segment. Their states come back
        in `marked`: the recurrent parts copied as each layer passes a mark, the attention caches'
        prefixes taken at the end (a causal layer's first keys do not change)."""
        if tokens.ndim != 1 or tokens.shape[0] == 0:
            raise ValueError(f"forward takes a non-empty 1-D tensor of token ids, got shape {tuple(tokens.shape)}")
        marks = list(marks)
        if marks and (depth is not None or marks != sorted(set(marks)) or not 0 < marks[0] <= marks[-1] < len(tokens)):
            raise ValueError(f"marks must ascend strictly inside the {len(tokens)} tokens of a full step, got {marks}")
        host_tokens = tokens.cpu()  # the PLE layers hash them on the host: no read-back mid-step
        streams = self.embed(tokens.to(self.device)).repeat(1, self.config.hc_count)  # [T, hc*H]
        marked = [SequenceState(position=state.position + mark, deltanet={}, attention={}, ple={}) for mark in marks]
        for layer in self.layers[:depth]:
            state.arrive(layer.layer)  # a stored state still being read: this layer's parts
            streams = layer(streams, host_tokens, state, marks=marks, marked=marked)
        state.arrive_all()
        for at in marked:
            at.attention = state.checkpoint_attention(at.position, len(self.layers))
        logits = self.logits(streams[-1:] if last_only else streams)
        state.position += tokens.shape[0]
        return StepOutput(logits=logits, streams=streams, marked=marked or None)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_tokens)

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Pre-final-mixer streams [T, hc*H] -> logits [T, vocab]."""
        hidden, _ = self.final_mixer.mix(streams)
        return F.linear(hidden, self.lm_head)
