"""CUDA graphs for speculative decoding's checked steps: a token and its k drafts through every
decoder layer as one step, replayed, not re-issued.

A checked step of T = k + 1 tokens issued eagerly launches several hundred small kernels a layer
(its DeltaNet recurrence and its attention run token by token, so that the step can stand after
any of them), and the host, not the GPU, sets its pace: many times a one-token step replayed
from decode_graphs.py, which throws away what checking k drafts at once saves. So a checked step
is a chain of graphs too, one a layer, captured for each T that comes (a drafter proposes up to
`EngineConfig.draft_tokens`; T stays within the decode kernels' rows, DECODE_MAX_TOKENS):

    graph(layer L: [PLE addend over T rows,] mix, sequence mixer, combine, mix, router, shared
          expert, the routed experts of all T rows from the bank, combine) -> graph(layer L + 1) ...

Within a layer the projections, routers and experts take the T rows at once; the DeltaNet
recurrence runs its T one-token computations (the state after each kept in buffers of the graph
for `SequenceState.rewind`), and attention writes and attends one token after another at
position + t (`QSAAttention.attend_step`), which is causal by construction. The tracked parts a
rewind reads (DeltaNet's per-token states and conv window, PLE's conv window) are graph outputs,
handed back to the state after every replay. The PLE rows are gathered on the host before the
layers, as for decode, and the logits of all T rows are computed after them.

With every expert resident (a bank and its slot table, `BankExperts`) a layer is one graph. Through
a tiered store (`StoreExperts`) a step may meet a record on disk, which no graph can wait for, so
each layer's graph stops at its router, and the routed experts of its T rows run eagerly between
the graphs, as a decode step redone through the store runs (decode_graphs.py):

    graph(combine layer L - 1's experts, [PLE addend,] mix, sequence mixer, combine, mix, router,
          shared expert, the next two layers' predictions) ->
    eager(expert ids to the host, the store, the experts' kernels, the predicted prefetched) -> ...

With
`compiled`, the parts without a per-token loop (the hyper-connection mixes, the router and shared
expert, the experts' combine) are compiled by torch.compile with the step length dynamic, once for
every T, fused as the decode graphs' pieces are; the mixers' per-token loops run as they are, or,
with `compile_mixers`, are compiled too, unrolled, once for each T. Like decode
graphs, they are bound to the sequence state's buffers; a state with other buffers (a new
sequence, an attention cache that grew) has them captured again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from flashpack.runtime.engine import graph_pieces as pieces
from flashpack.runtime.engine.captured_call import CapturedCall
from flashpack.runtime.engine.expert_paths import BankExperts, StoreExperts, fused_experts
from flashpack.runtime.kernels.dispatch import DECODE_MAX_TOKENS
from flashpack.runtime.model.decoder_layer import DecoderLayer
from flashpack.runtime.state import SequenceState

MAX_CHECKED_TOKENS = DECODE_MAX_TOKENS  # more rows would leave the decode kernels: such a step runs eagerly
# the step lengths a short prompt is cut into (chunk_lengths): a few, so that few graphs are compiled
# and captured for it, all of them at the warm-up (Generator.warm_up)
PROMPT_CHUNKS = (16, 8, 4, 3, 2)


def chunk_lengths(count: int) -> list[int]:
    """A prompt of `count` >= 2 tokens as checked steps of PROMPT_CHUNKS' lengths, longest first:
    16s, then the rest in eights, fours and twos, with a 3 where the count is odd (an odd rest of 1
    takes a 16 with it: 17 = 8 + 4 + 3 + 2)."""
    if count < 2:
        raise ValueError(f"a prompt in checked steps takes 2 or more tokens, got {count}")
    sixteens, rest = divmod(count, 16)
    if rest == 1:
        sixteens, rest = sixteens - 1, 17
    lengths = [16] * sixteens
    if rest % 2:
        rest -= 3
        odd = [3]
    else:
        odd = []
    for length in (8, 4, 2):
        while rest >= length:
            lengths.append(length)
            rest -= length
    return lengths + odd


def _ids(predicted: torch.Tensor) -> torch.Tensor | None:
    return predicted if predicted.numel() else None


class CheckedGraphs:
    def __init__(self, layers: nn.ModuleList, experts: BankExperts | StoreExperts,
                 make_call: Callable[..., CapturedCall] | None = None, compiled: bool = False,
                 compile_mixers: bool = False):
        """`make_call(fn, kept)` wraps each piece (default: a CapturedCall in one graph pool); the
        CPU tests pass a plain call to check how the layers are cut into pieces."""
        self.layers = list(layers)
        self.through_store = isinstance(experts, StoreExperts)
        compile_ = (lambda fn: torch.compile(fn, dynamic=True)) if compiled else (lambda fn: fn)
        self.mix, self.route = compile_(pieces.attention_mix), compile_(pieces.mixed_route)
        self.combine = compile_(pieces.expert_combine)
        # a loop over the step's tokens: specialised on T (a few values), not dynamic
        self.mixer = torch.compile(pieces.checked_mixer, dynamic=False) if compile_mixers else pieces.checked_mixer
        if compile_mixers:
            # one compile a step length and layer kind: TorchDynamo's default of 8 a function is
            # reached by speculation's four lengths alone, and a length past it would run uncompiled
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * MAX_CHECKED_TOKENS)
        self.experts = experts
        self.make_call = make_call
        self._pool = None
        self._bound_to: tuple[int, ...] | None = None
        self._state: SequenceState | None = None
        self._position: torch.Tensor | None = None  # int64 [1]: the step's first position
        self._pieces: dict[int, list[tuple[DecoderLayer, Callable]]] = {}  # by the step's token count
        self._runs: dict[int, int] = {}  # runs of each token count since the pieces were made

    def warming(self, tokens: int, state: SequenceState) -> bool:
        """Whether a run of `tokens` on `state` would still be a warm-up: each piece runs eagerly
        first (compiling its kernels) and is captured the second time (CapturedCall), seconds more
        than a replay; a state with other buffers has them made again."""
        return self.make_call is None and (self._runs.get(tokens, 0) < 2 or not self.bound(state))

    def takes(self, tokens: int) -> bool:
        return 1 < tokens <= MAX_CHECKED_TOKENS

    def run(self, streams: torch.Tensor, tokens: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """streams [T, hc*H] through every decoder layer for the T `tokens` (on the host) of a
        tracked step; advances `state` (not its position) and leaves it what `rewind` needs."""
        count = tokens.shape[0]
        if not state.tracked or not self.takes(count):
            raise ValueError(f"a checked step takes 2..{MAX_CHECKED_TOKENS} tokens of a tracked state, got {count}")
        for layer in self.layers:
            if not layer.linear:
                state.attention[layer.layer].reserve(state.position + count)
        self._bind(state, streams.device)
        self._state = state
        self._position.fill_(state.position)
        rows = {layer.layer: layer.ple.embed(tokens, state.ple[layer.layer])
                for layer in self.layers if layer.ple is not None}  # the n-gram context and its history
        self._runs[count] = self._runs.get(count, 0) + 1
        if self.through_store:
            streams = self._through_store(count, streams, rows, state)
        else:
            table = self.experts.source.slot_table
            for layer, call in self._pieces_for(count):
                ple = [rows[layer.layer]] if layer.ple is not None else []
                streams, *tracked = call(table, self._position, streams, *ple)
                self._hand_back(layer, state, tracked)
                for _ in range(count):
                    self.experts.source.count_replay(layer.layer)
        for layer in self.layers:
            if not layer.linear:
                state.attention[layer.layer].advance(count)
        return streams

    def _through_store(self, count: int, streams, rows, state: SequenceState) -> torch.Tensor:
        """Each layer's graph up to its router, then its T rows' experts through the store (decode's
        kernels, as a resident checked step runs them); the next layer's graph combines them."""
        carried = ()  # the layer before's (routed experts' output, shared expert's output, inject)
        for layer, call in self._pieces_for(count):
            ple = [rows[layer.layer]] if layer.ple is not None else []
            streams, x, inject, weights, experts, shared, predicted, far, *tracked = call(
                self._position, streams, *carried, *ple)
            self._hand_back(layer, state, tracked)
            routed = self.experts.from_store(layer.layer, x, weights, experts, _ids(predicted), _ids(far), prompt=False)
            carried = (routed, shared, inject)
        return self.combine(self.layers[-1], streams, *carried)

    @staticmethod
    def _hand_back(layer: DecoderLayer, state: SequenceState, tracked: list[torch.Tensor]) -> None:
        """A replay runs none of the Python that sets the tracked parts: set them from its outputs."""
        if layer.ple is not None:
            state.ple[layer.layer].window = tracked.pop(0)
        if layer.linear:
            state.deltanet[layer.layer].positions, state.deltanet[layer.layer].window = tracked

    def _pieces_for(self, count: int) -> list[tuple[DecoderLayer, Callable]]:
        if count not in self._pieces:
            first = self.layers[0]
            if self.through_store:
                # (position, streams, [the layer before's experts: routed, shared, inject,] [PLE
                # rows]): the position is the same tensor every step
                self._pieces[count] = [(layer, self._make(self._store_piece(layer, before), kept={0}))
                                       for layer, before in zip(self.layers, [None, *self.layers[:-1]])]
            else:
                # (table, position, streams, [PLE rows]): all but the first layer's streams and the
                # PLE rows are the same tensors every step
                self._pieces[count] = [
                    (layer, self._make(self._piece(layer), kept={0, 1} if layer is first else {0, 1, 2}))
                    for layer in self.layers]
        return self._pieces[count]

    def _make(self, fn: Callable, kept: set[int]) -> Callable:
        if self.make_call is not None:
            return self.make_call(fn, kept=kept)
        return CapturedCall(fn, self._pool, kept)

    def _piece(self, layer: DecoderLayer) -> Callable:
        """One layer of a checked step, every expert resident: (streams, [PLE conv window,]
        [DeltaNet states, conv window])."""
        bank = self.experts.source.bank

        def piece(table, position, streams, *ple_rows):
            streams, x, inject, weights, experts, shared, tracked = self._front(layer, position, streams, ple_rows)
            routed = fused_experts(x, bank, table[layer.layer][experts], weights, prompt=False)  # decode's kernels
            return (self.combine(layer, streams, routed, shared, inject), *tracked)

        return piece

    def _store_piece(self, layer: DecoderLayer, before: DecoderLayer | None) -> Callable:
        """One layer of a checked step through a store, up to its routed experts: the layer
        before's combined first; (streams, MoE input, its inject, routing weights, expert ids,
        shared expert output, the next layer's predicted ids, the layer after's, [PLE conv
        window,] [DeltaNet states, conv window]). A prediction the store does not make is an empty
        tensor (a graph's outputs are tensors)."""
        def piece(position, streams, *rest):
            if before is not None:
                routed, shared, inject, *rest = rest
                streams = self.combine(before, streams, routed, shared, inject)
            streams, x, inject, weights, experts, shared, tracked = self._front(layer, position, streams, rest)
            # the next layers' experts the store fetches behind this one's, as decode's prediction does
            predicted = [self.experts.predicted(layer.layer, x, ahead) for ahead in (1, 2)]
            predicted = [experts[:0] if ids is None else ids for ids in predicted]
            return (streams, x, inject, weights, experts, shared, *predicted, *tracked)

        return piece

    def _front(self, layer: DecoderLayer, position, streams, ple_rows):
        """A layer up to its routed experts: (streams, MoE input, its inject, routing weights, expert
        ids, shared expert output, the tracked parts a rewind reads)."""
        state = self._state
        ple_state = state.ple[layer.layer] if layer.ple is not None else None
        mixer_state = state.deltanet[layer.layer] if layer.linear else state.attention[layer.layer]
        if ple_state is not None:
            streams = streams + layer.ple.addend(streams, ple_rows[0], ple_state)  # tracked: its conv window
        block_input, inject = self.mix(layer, streams)
        mixed = self.mixer(layer, block_input, position, mixer_state)
        streams, x, inject, weights, experts, shared = self.route(layer, streams, mixed, inject)
        tracked = [ple_state.window] if ple_state is not None else []
        if layer.linear:
            tracked += [mixer_state.positions, mixer_state.window]
        return streams, x, inject, weights, experts, shared, tracked

    def bound(self, state: SequenceState) -> bool:
        """Whether the graphs are bound to `state`'s buffers (else a run captures them again)."""
        return self._key(state) == self._bound_to

    def _key(self, state: SequenceState) -> tuple[int, ...]:
        key = tuple(t.data_ptr() for s in state.deltanet.values() for t in (s.conv, s.recurrent))
        key += tuple(s.conv.data_ptr() for s in state.ple.values())
        return key + tuple(state.attention[layer.layer].buffers()[0].data_ptr()
                           for layer in self.layers if not layer.linear)

    def _bind(self, state: SequenceState, device: torch.device) -> None:
        key = self._key(state)
        if key == self._bound_to:
            return
        self._bound_to, self._pieces, self._runs = key, {}, {}
        if self.make_call is None:
            self._pool = torch.cuda.graph_pool_handle()
        self._position = torch.zeros(1, dtype=torch.int64, device=device)
