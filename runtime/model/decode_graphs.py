"""CUDA graphs for one-token decode steps: the decoder layers' fixed-shape work replayed, not re-issued.

A decode step launches some hundred small kernels per layer; issued one by one from Python, the
host, not the GPU, sets the pace. Nearly all of a step has the same shapes every time and reads
and writes the same buffers: DeltaNet and PLE state are updated in place, QSA attention writes
the new token into its cache at a device-side position and attends over the whole buffer under
a mask (`QSAAttention.attend_step`), a resident expert source looks slots up on the device. So:

    every expert resident   one graph for all the layers of the step
    a tiered store          one graph per layer, cut where the routed experts need the host:
                            graph(combine previous layer's experts, [PLE addend,] mix, mixer,
                            combine, mix, router, shared expert, next layer's prediction) ->
                            eager(expert ids to the host, the store, the expert kernels) -> ...

What stays eager around them: the PLE rows (hashed and gathered on the host from the step's
token), the embedding and the logits. Before each step the attention caches reserve room for the
token; when one has to grow, its buffers move and the graphs are captured again (the caches grow
by doubling, so that is rare). Each captured call runs eagerly the first time (which compiles and
warms kernels), is captured the second time and replayed from then on. Graphs read the state
buffers of the sequence they were captured with (a restored snapshot is copied into them); a
step with another sequence's state drops them and starts over (the Generator and the bench reset
one state in place for each new sequence, so theirs stay). A resident
expert source's requests are counted here, every step, since neither a replay nor the pieces call it.
`per_layer=True` gives every layer its own graph also when resident (bench/layer_costs.py times
layers apart that way).

With `compile_layers`, the pieces are first compiled by torch.compile (TorchInductor), which fuses
the hundred-odd small kernels of a layer (norms, gates, the hyper-connection mixing) into a few;
the graphs then replay the fused kernels. The pieces are module-level functions taking the layer
and its state as arguments, so every layer of a kind shares one compiled graph. The Triton
kernels of our own and flash-linear-attention's run as they are between compiled parts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from flashpack.runtime.kernels import moe_experts
from flashpack.runtime.model.decoder_layer import DecoderLayer
from flashpack.runtime.state import SequenceState


class CapturedCall:
    """fn(*tensors) -> tensor or tuple of tensors: eager once, then captured, then replayed."""

    def __init__(self, fn: Callable, pool):
        self.fn, self.pool = fn, pool
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[torch.Tensor] = []
        self.outputs = None

    def __call__(self, *inputs: torch.Tensor):
        self.calls += 1
        if self.calls == 1:
            return self.fn(*inputs)
        if self.graph is None:
            self.inputs = [x.clone() for x in inputs]
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: the store's copy and reader threads keep landing records on their own
            # streams while a layer is captured; in the default (global) mode any CUDA call of
            # theirs invalidates the capture (seen on the H200 with a tiered store).
            with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
                self.outputs = self.fn(*self.inputs)
        else:
            for static, x in zip(self.inputs, inputs):
                static.copy_(x)
        self.graph.replay()
        return self.outputs


def layer_front(layer: DecoderLayer, streams, position, ple_rows, ple_state, mixer_state):
    """[PLE addend,] attention-side mix, the sequence mixer, combine: streams before the MoE block."""
    if ple_rows is not None:
        streams = streams + layer.ple.addend(streams, ple_rows, ple_state)
    block_input, inject = layer.attn_hc.mix(streams)
    if layer.linear:
        mixed = layer.mixer(block_input, mixer_state)
    else:
        attention = layer.mixer
        q, gate, k, v, index_q, index_k = attention.project(block_input, position)
        mixed = attention.output(attention.attend_step(q, k, v, index_q, index_k, mixer_state, position), gate)
    return layer.attn_hc.combine(streams, mixed, inject)


def resident_feed_forward(layer: DecoderLayer, streams, slot_row, bank):
    """The MoE block with every expert resident: `slot_row` [num_experts] maps ids to bank rows."""
    x, inject = layer.mlp_hc.mix(streams)
    weights, experts, shared = layer.moe.gate(x)
    routed = moe_experts(x, bank, slot_row[experts], weights)
    return layer.mlp_hc.combine(streams, routed + shared, inject)


def tiered_route(layer: DecoderLayer, streams):
    """Up to the routed experts: (MoE input, its inject, routing weights, expert ids, shared expert
    output, next layer's predicted ids or None)."""
    x, inject = layer.mlp_hc.mix(streams)
    weights, experts, shared = layer.moe.gate(x)
    return x, inject, weights, experts, shared, layer.moe.predict_next(x)


def expert_combine(layer: DecoderLayer, streams, expert_output, inject):
    return layer.mlp_hc.combine(streams, expert_output, inject)


class DecodeGraphs:
    def __init__(
        self, layers: nn.ModuleList, count_replay: Callable[[int], None] | None = None,
        make_call: Callable[[Callable], CapturedCall] | None = None, per_layer: bool = False,
        compile_layers: bool = False,
    ):
        """`make_call(fn)` wraps each piece (default: a CapturedCall sharing one graph pool); the
        CPU tests pass a plain call to check how the layers are cut into pieces."""
        self.layers = list(layers)
        self.count_replay = count_replay  # count_replay(layer): a resident MoE block's requests
        self.make_call = make_call
        self.resident = all(layer.moe.resident is not None for layer in self.layers)
        self.per_layer = per_layer or not self.resident
        compiled = torch.compile if compile_layers else (lambda fn: fn)
        self.front, self.combine = compiled(layer_front), compiled(expert_combine)
        self.feed_forward, self.route = compiled(resident_feed_forward), compiled(tiered_route)
        self._bound_to: tuple[int, ...] | None = None
        self._state: SequenceState | None = None
        self._pieces: list[tuple[list[DecoderLayer], CapturedCall]] = []

    def run(
        self, streams: torch.Tensor, tokens: torch.Tensor, state: SequenceState,
        after_layer: Callable[[DecoderLayer], None] | None = None,
    ) -> torch.Tensor:
        """streams [1, hc*H] through every decoder layer for one token (`tokens` [1] on the host);
        advances `state` (not its position). `after_layer(layer)` is called after each piece's
        work is issued (per_layer: after each layer; bench/layer_costs.py)."""
        for layer in self.layers:
            if not layer.linear:
                state.attention[layer.layer].reserve(state.position + 1)
        self._bind(state)
        self._state = state
        position = torch.full((1,), state.position, dtype=torch.int64, device=streams.device)
        carried = ()  # tiered: the previous layer's (routed + shared expert output, inject), combined next
        for layers, call in self._pieces:
            rows = [layer.ple.embed(tokens, state.ple[layer.layer]) for layer in layers if layer.ple is not None]
            if self.resident:
                streams = call(streams, position, *rows)
            else:
                (layer,) = layers
                streams, x, inject, weights, experts, shared, predicted = call(streams, position, *carried, *rows)
                routed = layer.moe.routed_from_store(x, weights, experts, predicted)
                carried = (routed + shared, inject)
            if self.count_replay is not None:
                for layer in layers:
                    self.count_replay(layer.layer)
            if after_layer is not None:
                after_layer(layers[-1])
        if carried:
            streams = self.combine(self.layers[-1], streams, *carried)
        for layer in self.layers:
            if not layer.linear:
                state.attention[layer.layer].advance(1)
        return streams

    def _mixer_state(self, layer: DecoderLayer):
        return self._state.deltanet[layer.layer] if layer.linear else self._state.attention[layer.layer]

    def _layer_front(self, layer: DecoderLayer, streams, position, rows):
        ple_state = self._state.ple[layer.layer] if layer.ple is not None else None
        ple_rows = next(rows) if layer.ple is not None else None
        return self.front(layer, streams, position, ple_rows, ple_state, self._mixer_state(layer))

    def _resident_layers(self, layers: list[DecoderLayer]) -> Callable:
        resident = layers[0].moe.resident

        def step(streams, position, *ple_rows):
            rows = iter(ple_rows)
            for layer in layers:
                streams = self._layer_front(layer, streams, position, rows)
                streams = self.feed_forward(layer, streams, resident.slot_table[layer.layer], resident.bank)
            return streams

        return step

    def _tiered_layer(self, layer: DecoderLayer, previous: DecoderLayer | None) -> Callable:
        """(streams, MoE input, its inject, routing weights, expert ids, shared expert output,
        next layer's predicted ids or None), the previous layer's experts combined first."""
        def step(streams, position, *rest):
            if previous is not None:
                expert_output, inject, *rest = rest
                streams = self.combine(previous, streams, expert_output, inject)
            streams = self._layer_front(layer, streams, position, iter(rest))
            return (streams, *self.route(layer, streams))

        return step

    def _bind(self, state: SequenceState) -> None:
        key = tuple(t.data_ptr() for s in state.deltanet.values() for t in (s.conv, s.recurrent))
        key += tuple(s.conv.data_ptr() for s in state.ple.values())
        key += tuple(state.attention[layer.layer].buffers()[0].data_ptr() for layer in self.layers if not layer.linear)
        if key == self._bound_to:
            return
        self._bound_to = key
        make_call = self.make_call
        if make_call is None:
            pool = torch.cuda.graph_pool_handle()
            make_call = lambda fn: CapturedCall(fn, pool)  # noqa: E731
        if not self.resident:
            previous = [None, *self.layers[:-1]]
            self._pieces = [([layer], make_call(self._tiered_layer(layer, before)))
                            for layer, before in zip(self.layers, previous)]
        elif self.per_layer:
            self._pieces = [([layer], make_call(self._resident_layers([layer]))) for layer in self.layers]
        else:
            self._pieces = [(self.layers, make_call(self._resident_layers(self.layers)))]
