"""CUDA graphs for one-token decode steps: the decoder layers' fixed-shape work replayed, not re-issued.

A decode step launches some hundred small kernels per layer; issued one by one from Python, the
host, not the GPU, sets the pace. Most of a layer has the same shapes at every step and reads and
writes the same buffers (DeltaNet keeps its state in place, a resident expert source looks slots
up on the device), so it is captured once and replayed. What stays eager:

    PLE rows          hashed and gathered on the host from the pack by the step's token ids
    QSA's cache       appending the new keys, pooling blocks, the indexer's pick and the attention
                      itself: the key count grows every step

so a DeltaNet layer runs as [PLE rows eager] -> graph([PLE addend,] mix, DeltaNet, feed-forward), and
a QSA layer as graph(mix, projections at the step's position) -> eager cache attention -> graph(output,
feed-forward). With a tiered store the routed experts need the host (their ids pick what the store
loads), so the feed-forward graph stops after the router, the shared expert and the next layer's
prediction, and the routed experts and the last combine run eagerly between graphs.
Each captured call runs eagerly the first time (which compiles and warms kernels), is captured the
second time and replayed from then on. Graphs read the DeltaNet and PLE state buffers of the
sequence they were captured with (a restored snapshot is copied into them); a step with another
sequence's state (a new request) drops them and starts over. A resident expert source's stats are counted per replay here, since a
replay runs no Python.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

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
            with torch.cuda.graph(self.graph, pool=self.pool):
                self.outputs = self.fn(*self.inputs)
        else:
            for static, x in zip(self.inputs, inputs):
                static.copy_(x)
        self.graph.replay()
        return self.outputs


class DecodeGraphs:
    def __init__(
        self, layers: nn.ModuleList, count_replay: Callable[[int], None] | None = None,
        make_call: Callable[[Callable], CapturedCall] | None = None,
    ):
        """`make_call(fn)` wraps each piece (default: a CapturedCall sharing one graph pool); the
        CPU tests pass a plain call to check how the layers are cut into pieces."""
        self.layers = layers
        self.count_replay = count_replay  # count_replay(layer): a replayed MoE's requests
        self.make_call = make_call
        self._bound_to: tuple[int, ...] | None = None
        self._state: SequenceState | None = None
        self._pieces: list[tuple[DecoderLayer, CapturedCall, CapturedCall | None]] = []

    def run(
        self, streams: torch.Tensor, tokens: torch.Tensor, state: SequenceState,
        after_layer: Callable[[DecoderLayer], None] | None = None,
    ) -> torch.Tensor:
        """streams [1, hc*H] through every decoder layer for one token; advances `state`.
        `after_layer(layer)` is called after each layer's work is issued (bench/layer_costs.py)."""
        self._bind(state)
        self._state = state
        for layer, first, second in self._pieces:
            if second is None:  # DeltaNet: the rest of the layer is one graph
                if layer.ple is None:
                    out = first(streams)
                else:
                    out = first(streams, layer.ple.embed(tokens, state.ple[layer.layer]))
            else:
                cache = state.attention[layer.layer]
                positions = torch.full((1,), cache.length, dtype=torch.int64, device=streams.device)
                inject, q, gate, k, v, index_q, index_k = first(streams, positions)
                attended = layer.mixer.attend_cache(q, k, v, index_q, index_k, cache)
                out = second(streams, attended, gate, inject)
            streams = out if layer.moe.resident is not None else self._routed_from_store(layer, *out)
            if self.count_replay is not None and (second or first).graph is not None:
                self.count_replay(layer.layer)
            if after_layer is not None:
                after_layer(layer)
        return streams

    @staticmethod
    def _routed_from_store(layer: DecoderLayer, streams, x, inject, weights, experts, shared, predicted):
        """The eager middle of a tiered layer: expert ids to the host, the store, the kernels."""
        routed = layer.moe.routed_from_store(x, weights, experts, predicted)
        return layer.mlp_hc.combine(streams, routed + shared, inject)

    def _after_mixer(self, layer: DecoderLayer, streams, block_output, inject):
        """With every expert resident, the whole feed-forward; with a tiered store, everything up
        to the routed experts (which need the host): (streams, MoE input, its inject, routing
        weights, expert ids, shared expert output, next layer's predicted ids or None)."""
        if layer.moe.resident is not None:
            return layer.feed_forward(streams, block_output, inject)
        streams = layer.attn_hc.combine(streams, block_output, inject)
        x, mlp_inject = layer.mlp_hc.mix(streams)
        weights, experts = layer.moe.route(x)
        return streams, x, mlp_inject, weights, experts, layer.moe.shared(x), layer.moe.predict_next(x)

    def _bind(self, state: SequenceState) -> None:
        key = tuple(t.data_ptr() for s in state.deltanet.values() for t in (s.conv, s.recurrent))
        key += tuple(s.conv.data_ptr() for s in state.ple.values())
        if key == self._bound_to:
            return
        self._bound_to, self._pieces = key, []
        make_call = self.make_call
        if make_call is None:
            pool = torch.cuda.graph_pool_handle()
            make_call = lambda fn: CapturedCall(fn, pool)  # noqa: E731
        for layer in self.layers:
            if layer.linear:
                def whole(streams, ple_rows=None, layer=layer):
                    if ple_rows is not None:
                        streams = streams + layer.ple.addend(streams, ple_rows, self._state.ple[layer.layer])
                    block_input, inject = layer.attn_hc.mix(streams)
                    return self._after_mixer(layer, streams, layer.sequence_mixer(block_input, self._state), inject)

                self._pieces.append((layer, make_call(whole), None))
            else:
                if layer.ple is not None:
                    raise ValueError(f"layer {layer.layer}: PLE before a QSA layer is not laid out for CUDA graphs")

                def attention_in(streams, positions, layer=layer):
                    block_input, inject = layer.attn_hc.mix(streams)
                    return (inject, *layer.mixer.project(block_input, positions))

                def attention_out(streams, attended, gate, inject, layer=layer):
                    return self._after_mixer(layer, streams, layer.mixer.output(attended, gate), inject)

                self._pieces.append((layer, make_call(attention_in), make_call(attention_out)))
