"""The qwen4_exp text model as one step function: tokens of one sequence in, logits out.

    embed -> repeat into hc streams -> decoder layers -> final mixer -> lm_head

`forward(tokens, state)` takes any number of new tokens of one sequence: a whole prompt (prefill),
one token (decode), or a few (speculative verification); the state carries everything needed to
continue. It also returns the pre-final-mixer streams, which the MTP head consumes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flashpack.runtime.experts import ExpertFetcher
from flashpack.runtime.model.decode_graphs import LAYERS_PER_GRAPH, DecodeGraphs
from flashpack.runtime.model.decoder_layer import DecoderLayer
from flashpack.runtime.model.hyper_connection import GatedResidual
from flashpack.runtime.model.rope import Rotary
from flashpack.runtime.state import SequenceState
from flashpack.runtime.weights import WeightSource, load_dense


@dataclass
class StepOutput:
    logits: torch.Tensor  # [T, vocab] (or [1, vocab] with last_only), engine dtype
    streams: torch.Tensor  # [T, hc * H] pre-final-mixer hidden streams: the MTP head's input


class Qwen4ExpModel(nn.Module):
    def __init__(
        self, source: WeightSource, fetcher: ExpertFetcher, dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        cfg = self.config = source.config
        self.dtype, self.device = dtype, torch.device(device)
        self.rotary = Rotary(cfg, self.device)
        self.register_buffer("embed_tokens", load_dense(source, "embed_tokens.weight", dtype, device), persistent=False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, source, fetcher, layer, f"layers.{layer}.", self.rotary, dtype, device)
            for layer in range(cfg.num_hidden_layers)
        )
        self.decode_graphs: DecodeGraphs | None = None
        self.final_mixer = GatedResidual(cfg, source, "hyper_connection_mixer.", dtype, device, inject=False)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.register_buffer("lm_head", load_dense(source, "lm_head.weight", dtype, device), persistent=False)

    def capture_decode_graphs(self, count_replay=None, compile_layers: bool = True,
                              layers_per_graph: int = LAYERS_PER_GRAPH) -> None:
        """Replay each decode step's fixed-shape layer work from CUDA graphs (decode_graphs.py), on
        a GPU with an ExpertSlots source; `count_replay(layer)` counts a resident MoE block's
        requests; `compile_layers` fuses the graphs' small kernels with torch.compile first."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need the engine on a CUDA device")
        if self.layers[0].moe.slots is None:
            raise ValueError("CUDA graphs need an ExpertSlots source (the store), not dequantised experts")
        self.decode_graphs = DecodeGraphs(self.layers, count_replay, compile_layers=compile_layers,
                                          layers_per_graph=layers_per_graph)

    def observe_routing(self, observer: Callable[[int, torch.Tensor], None] | None) -> None:
        """Call `observer(layer, expert ids [T, k])` with every MoE block's routing, as the layers
        run eagerly (decode graphs replay without it: a profiling run goes without them)."""
        if observer is not None and self.decode_graphs is not None:
            raise ValueError("routing is observed in eager decode: load the engine without CUDA graphs")
        for layer in self.layers:
            layer.moe.routing_observer = observer

    def fuse_hyper_connections(self, enabled: bool = True) -> None:
        """Run one-token hyper-connection mixes (two a layer, and the final mixer's) as two Triton
        kernels each (runtime/kernels/hc_mix.py) instead of the module's plain code."""
        if enabled and self.device.type != "cuda":
            raise ValueError("fused hyper-connection mixes run on CUDA only")
        for mixer in [self.final_mixer, *(hc for layer in self.layers for hc in (layer.attn_hc, layer.mlp_hc))]:
            mixer.fused = enabled

    def prefetch_next_layer(self, enabled: bool = True, read_ahead: bool = False) -> None:
        """Let each MoE block name the next layer's likely experts to a tiered store in decode, and
        with `read_ahead` the disk-only records the layer after next is likely to pick."""
        for layer, following in zip(self.layers, self.layers[1:]):
            layer.moe.next_moe = following.moe if enabled else None
            layer.moe.read_ahead = enabled and read_ahead

    def settle(self) -> None:
        """Finish the bookkeeping decode steps defer (decode_graphs.DecodeGraphs.settle): call it
        before reading the expert store's counters."""
        if self.decode_graphs is not None:
            self.decode_graphs.settle()

    def new_state(self) -> SequenceState:
        return SequenceState.empty(self.config, self.dtype, self.device)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, state: SequenceState, last_only: bool = False,
                depth: int | None = None) -> StepOutput:
        """tokens int64 [T] (the next T tokens of the sequence) -> StepOutput; advances `state` by T.
        `depth`: run only the first `depth` decoder layers (a warm-up builds every kernel a prompt
        needs from one layer of each kind; the state is then good for nothing else)."""
        if tokens.ndim != 1 or tokens.shape[0] == 0:
            raise ValueError(f"forward takes a non-empty 1-D tensor of token ids, got shape {tuple(tokens.shape)}")
        host_tokens = tokens.cpu()  # the PLE layers hash them on the host: no read-back mid-step
        streams = self.embed(tokens.to(self.device)).repeat(1, self.config.hc_count)  # [T, hc*H]
        if self.decode_graphs is not None and tokens.shape[0] == 1 and depth is None:
            streams, logits = self.decode_graphs.run(streams, host_tokens, state, head=self.logits)
        else:
            for layer in self.layers[:depth]:
                streams = layer(streams, host_tokens, state)
            logits = self.logits(streams[-1:] if last_only else streams)
        state.position += tokens.shape[0]
        return StepOutput(logits=logits, streams=streams)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_tokens)

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Pre-final-mixer streams [T, hc*H] -> logits [T, vocab]."""
        hidden, _ = self.final_mixer.mix(streams)
        return F.linear(hidden, self.lm_head)
