"""One decoder layer: [PLE] -> hc mix -> DeltaNet or QSA attention -> hc combine -> hc mix -> MoE -> hc combine.

Works on the hc-stream residual [T, hc * H]. Each layer finds its own recurrent pieces in the
`SequenceState` by its layer index; the MTP head's layer is built by the same class at index
num_hidden_layers + j (QSA, no PLE).

The code between the sequence mixer and the routed experts is three module-level functions of the
layer (`mixer_input`, `moe_input`, `moe_output`), compiled with `compile_pieces` (compiled.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flashpack.layout.model_config import TextConfig
from flashpack.runtime.model.compiled import piece
from flashpack.runtime.model.routed_experts import RoutedExperts
from flashpack.runtime.model.deltanet import GatedDeltaNet
from flashpack.runtime.model.hyper_connection import GatedResidual
from flashpack.runtime.model.moe import SparseMoE
from flashpack.runtime.model.ple import PLELayer
from flashpack.runtime.model.qsa_attention import QSAAttention
from flashpack.runtime.model.rope import Rotary
from flashpack.runtime.state import SequenceState
from flashpack.runtime.weights import WeightSource


def mixer_input(layer: DecoderLayer, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention-side hyper-connection mix: (the sequence mixer's input [T, H], inject [T, hc])."""
    return layer.attn_hc.mix(streams)


def moe_input(layer: DecoderLayer, streams: torch.Tensor, mixed: torch.Tensor, inject: torch.Tensor):
    """The mixer's output combined into the streams, the MoE-side mix, the router and the shared
    expert: (streams, MoE input, its inject, routing weights, expert ids, shared expert output)."""
    streams = layer.attn_hc.combine(streams, mixed, inject)
    x, inject = layer.mlp_hc.mix(streams)
    return (streams, x, inject, *layer.moe.gate(x))


def moe_output(layer: DecoderLayer, streams: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor,
               inject: torch.Tensor) -> torch.Tensor:
    """The routed and the shared experts' outputs combined into the streams."""
    return layer.mlp_hc.combine(streams, routed + shared, inject)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: TextConfig, source: WeightSource, routed: RoutedExperts, layer: int, prefix: str,
        rotary: Rotary, dtype: torch.dtype, device,
    ):
        super().__init__()
        self.layer = layer
        self.linear = layer < cfg.num_hidden_layers and cfg.is_linear(layer)
        ple_index = cfg.ple_index(layer) if layer < cfg.num_hidden_layers else None
        self.ple = PLELayer(cfg, source, prefix + "ple.", ple_index, dtype, device) if ple_index is not None else None
        self.attn_hc = GatedResidual(cfg, source, prefix + "attn_hyper_connection.", dtype, device)
        if self.linear:
            self.mixer = GatedDeltaNet(cfg, source, prefix + "linear_attn.", dtype, device)
        else:
            self.mixer = QSAAttention(cfg, source, prefix + "self_attn.", rotary, dtype, device)
        self.mlp_hc = GatedResidual(cfg, source, prefix + "mlp_hyper_connection.", dtype, device)
        self.moe = SparseMoE(cfg, source, prefix + "mlp.", layer, routed, dtype, device)
        self.compile_pieces = False  # the model sets it (compiled.py)

    def forward(
        self, streams: torch.Tensor, tokens: torch.Tensor, state: SequenceState,
        pending: torch.Tensor | None = None, marks: Sequence[int] = (), marked: Sequence[SequenceState] = (),
    ) -> torch.Tensor:
        """streams [T, hc*H], tokens [T] -> streams [T, hc*H]; advances this layer's part of `state`.

        `pending` [T, H] is a block output still to be added to every stream with unit weight
        before this layer (the MTP head's projected token embedding). `marks`: token counts within
        the T (ascending, inside 0 < m < T) after which this layer's recurrent parts (DeltaNet, PLE)
        are copied into `marked` (one state each)."""
        if marks:
            return self._marked(streams, tokens, state, marks, marked)
        streams = self.add_inputs(streams, tokens, state, pending)
        block_input, inject = piece(mixer_input, self.compile_pieces)(self, streams)
        return self.feed_forward(streams, self.sequence_mixer(block_input, state), inject)

    def _marked(self, streams, tokens, state: SequenceState, marks: Sequence[int], marked: Sequence[SequenceState]
                ) -> torch.Tensor:
        """The whole step at once, as an unmarked one, with each mark's state kept on the way: PLE's
        n-gram context and conv tail are slices of the step's history and window (the PLE state is
        tracked through the step), DeltaNet runs its recurrence segment by segment (GatedDeltaNet's
        `marks`). Attention has nothing to keep here: its caches' prefixes are taken at the end."""
        if self.ple is not None:
            ple = state.ple[self.layer]
            ple.tracked = True
            streams = streams + self.ple(streams, tokens, ple)
            for at, mark in zip(marked, marks):
                at.ple[self.layer] = ple.at(mark)
            ple.rewind(tokens.shape[0])  # the state it holds already, untracked
        block_input, inject = piece(mixer_input, self.compile_pieces)(self, streams)
        if not self.linear:
            return self.feed_forward(streams, self.mixer(block_input, state.attention[self.layer]), inject)
        states: list = []
        mixed = self.mixer(block_input, state.deltanet[self.layer], marks, states)
        for at, part in zip(marked, states):
            at.deltanet[self.layer] = part
        return self.feed_forward(streams, mixed, inject)

    def add_inputs(
        self, streams: torch.Tensor, tokens: torch.Tensor, state: SequenceState, pending: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The MTP head's pending block output and this layer's PLE rows (read on the host)."""
        if pending is not None:
            streams = self.attn_hc.combine(streams, pending, None)
        if self.ple is not None:
            streams = streams + self.ple(streams, tokens, state.ple[self.layer])
        return streams

    def sequence_mixer(self, block_input: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """DeltaNet or QSA attention over block_input [T, H], continuing this layer's state."""
        if self.linear:
            return self.mixer(block_input, state.deltanet[self.layer])
        return self.mixer(block_input, state.attention[self.layer])

    def feed_forward(self, streams: torch.Tensor, block_output: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        """Combine the mixer's output into the streams, then the MoE block around its own mix."""
        streams, x, inject, weights, experts, shared = piece(moe_input, self.compile_pieces)(
            self, streams, block_output, inject)
        routed = self.moe.routed_output(x, weights, experts)
        return piece(moe_output, self.compile_pieces)(self, streams, routed, shared, inject)
