"""CUDA graphs for one-token decode steps: the decoder layers' fixed-shape work replayed, not re-issued.

A decode step launches some hundred small kernels per layer; issued one by one from Python, the
host, not the GPU, sets the pace. Nearly all of a step has the same shapes every time and reads
and writes the same buffers: DeltaNet and PLE state are updated in place, QSA attention writes
the new token into its cache at a device-side position and attends over the whole buffer under
a mask (`QSAAttention.attend_step`), and the routed experts' slots can be looked up on the device
in a slot table. So a step is a chain of graphs, one a layer, each handing its outputs to the
next in place (captured_call.CapturedCall's `kept` inputs). One graph a layer, not one a step:
launching a graph takes the host about a microsecond a node, and the GPU runs layer L while the
host launches layer L + 1, where a whole step's graph would idle the GPU through its launch.

    every expert resident   the source's slot table never misses: the chain is the whole step
    a tiered store          the store publishes where each expert is now, a device slot, a
                            host-cache slot or only on disk (TabledSlots.hold_slot_table), and
                            the graphs run against that: they stage host-cache experts into the
                            bank's staging rows themselves (kernels.stage_records, reading pinned
                            host memory over PCIe) and report every expert found only on disk
                            (zero-weighted meanwhile). Each layer applies the next layer's router
                            to its MoE input (the prediction); the next layer's graph starts by
                            staging the predicted host experts on a side stream, beside its
                            sequence mixer, router and shared expert, and after its own router
                            stages only what the prediction missed. Inside a graph of several
                            layers the staging starts earlier, right after the layer before's
                            router, beside that layer's experts too (even and odd layers stage
                            into two row sets; a graph must join what it forks, so only a
                            graph's first layer waits for its own start). One read-back after the
                            step, of the report every layer wrote: nothing on disk, the step
                            stands and the store counts what it used (and may promote staged
                            experts to device slots in the background), once the next step's
                            graphs are launched or at `settle()`, which readers of the store's
                            counters call first; something on disk, the step is redone through
                            the store from a copy of the state the first graph took. That redo
                            is one graph per layer too, cut at the routed experts:
                                graph(combine previous layer's experts, [PLE addend,] mix, mixer,
                                combine, mix, router, shared expert, the next two layers'
                                predictions) ->
                                eager(expert ids to the host, the store, the expert kernels) -> ...
                            A failed try waits 2, 4, ... 64 steps before the next (`Speculation`),
                            so a budget that misses every step pays for few of them.

What stays eager around them: the PLE rows (hashed and gathered on the host from the step's
token, once per step), the embedding and the logits. Before each step the attention caches
reserve room for the token; when one has to grow, its buffers move and the graphs are captured
again (the caches grow by doubling, so that is rare). A redone step writes the same attention
cache entries again, so only DeltaNet and PLE state are copied. Each captured call runs eagerly
the first time (which compiles and warms kernels), is captured the second time and replayed
from then on. Graphs read the state buffers of the sequence they were captured with (a restored
snapshot is copied into them); a step with another sequence's state drops them and starts over
(the Generator and the bench reset one state in place for each new sequence, so theirs stay). A
resident expert source's requests are counted here, every step, since neither a replay nor the
pieces call it.

With `compile_layers`, the pieces are first compiled by torch.compile (TorchInductor), which fuses
the hundred-odd small kernels of a layer (norms, gates, the hyper-connection mixing) into a few;
the graphs then replay the fused kernels. The pieces are module-level functions taking the layer
and its state as arguments (graph_pieces.py), so every layer of a kind shares one compiled graph.
The Triton kernels of our own and flash-linear-attention's run as they are between compiled parts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn

from flashpack.runtime.engine import graph_pieces as pieces
from flashpack.runtime.engine.captured_call import CapturedCall
from flashpack.runtime.engine.expert_paths import BankExperts, StoreExperts
from flashpack.runtime.experts import HostRecords, TabledSlots, ahead_rows
from flashpack.runtime.kernels import moe_experts, stage_records
from flashpack.runtime.model.decoder_layer import DecoderLayer
from flashpack.runtime.engine.step_report import Speculation, StagingCounts, count_step, report_row
from flashpack.runtime.state import SequenceState


class DecodeGraphs:
    def __init__(
        self, layers: nn.ModuleList, experts: BankExperts | StoreExperts,
        count_replay: Callable[[int], None] | None = None, make_call: Callable[..., CapturedCall] | None = None,
        compile_layers: bool = False, layers_per_graph: int = 1, combo_kernels: bool = True,
        staging_programs: int = 32, staged_beside_experts: int = 1,
    ):
        """`experts`: the layers' routed experts (a resident bank or a tiered store). `make_call(fn,
        kept)` wraps each piece (default: a CapturedCall; the table's pieces and the store's share
        no graph pool, since a redo replays them out of capture order); the CPU tests pass a plain
        call to check how the layers are cut into pieces. `layers_per_graph`: how many layers a
        step's graph covers (the store's redo pieces have one each). `combo_kernels`: TorchInductor
        launches a piece's independent small kernels as one. `staging_programs`: programs of the
        side stream's staging kernel. `staged_beside_experts`: of the next layer's predicted host
        records, how many a graph's last layer stages beside its own experts (EngineConfig says why)."""
        if layers_per_graph < 1:
            raise ValueError(f"layers_per_graph must be at least 1, got {layers_per_graph}")
        self.layers = list(layers)
        self.layers_per_graph = min(layers_per_graph, len(self.layers))
        self.experts = experts
        self.count_replay = count_replay  # count_replay(layer): a resident MoE block's requests
        self.make_call = make_call
        self.staging_programs, self.staged_beside_experts = staging_programs, staged_beside_experts
        self.resident = isinstance(experts, BankExperts)
        source = experts.source
        self.tabled = source if not self.resident and isinstance(source, TabledSlots) else None
        self.speculation = Speculation() if self.tabled is not None else None
        self.staging = StagingCounts()
        # the layer whose router predicts each layer's next experts (None: no prediction)
        predicting = not self.resident and bool(experts.routers)
        self._next_moe = {layer.layer: after.moe if predicting and after is not None else None
                          for layer, after in zip(self.layers, [*self.layers[1:], None])}
        self._predicts = [self._next_moe[layer.layer] is not None for layer in self.layers]  # for count_step
        options = {"combo_kernels": True} if combo_kernels else {}
        compiled = (lambda fn: torch.compile(fn, options=options)) if compile_layers else (lambda fn: fn)
        self.front, self.combine = compiled(pieces.layer_front), compiled(pieces.expert_combine)
        self.route = compiled(pieces.tiered_route)
        self.table_slots, self.ahead_offsets = compiled(pieces.table_slots), compiled(pieces.ahead_offsets)
        self._side: torch.cuda.Stream | None = None  # stages the next layer's predicted experts
        self._bound_to: tuple[int, ...] | None = None
        self._state: SequenceState | None = None
        self._position: torch.Tensor | None = None  # int64 [1], the step's position, read by every piece
        self._report: torch.Tensor | None = None  # int32 [layers, 3 + 3k], written by the table pieces
        self._table_pieces: list[tuple[list[DecoderLayer], CapturedCall]] = []
        self._store_pieces: list[tuple[DecoderLayer, CapturedCall]] = []
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live state, its copy) for redoing a step
        self._unrecorded: list[list[int]] | None = None  # the report of a step that stood, not yet counted
        self._settling = threading.Lock()
        # begin() before a step's layers, lap(layer) after each (runtime.bench.clock.LayerClock): how
        # the bench tells a step's per-layer time from its per-step time, and one layer's from another's
        self.layer_clock = None

    def run(
        self, streams: torch.Tensor, tokens: torch.Tensor, state: SequenceState,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [1, hc*H] through every decoder layer for one token (`tokens` [1] on the host);
        advances `state` (not its position). Returns the streams and `head(streams)` (or None),
        issued as soon as the layers are: with a tiered store before the step's read-back, so the
        host issues it while the GPU still runs the layers."""
        for layer in self.layers:
            if not layer.linear:
                state.attention[layer.layer].reserve(state.position + 1)
        self._bind(state, streams.device)
        self._state = state
        self._position.fill_(state.position)
        rows = {layer.layer: layer.ple.embed(tokens, state.ple[layer.layer])
                for layer in self.layers if layer.ple is not None}  # advances the n-gram context: once
        head = head or (lambda streams: None)
        if self.resident:
            streams = self._through_table(streams, self.experts.source.slot_table, rows)
            out = streams, head(streams)
        else:
            out = self._try_table(streams, rows, head) if self.speculation is not None else None
            if out is None:
                streams = self._through_store(streams, rows)
                out = streams, head(streams)
        for layer in self.layers:
            if not layer.linear:
                state.attention[layer.layer].advance(1)
        return out

    def _through_table(self, streams, table, rows) -> torch.Tensor:
        """Launch the table pieces, layer after layer, each handed the one before's outputs."""
        self._begin_laps()
        carried = ()  # the previous layer's prediction of the next piece's first layer's experts
        for layers, call in self._table_pieces:
            streams, *carried = call(table, self._position, streams, *self._rows_of(layers, rows), *carried)
            for layer in layers:
                if self.count_replay is not None:
                    self.count_replay(layer.layer)
            self._lap(layers[-1])  # a piece of several layers is timed as a whole, under its last
        return streams

    def _begin_laps(self) -> None:
        if self.layer_clock is not None:
            self.layer_clock.begin()

    def _lap(self, layer: DecoderLayer) -> None:
        if self.layer_clock is not None:
            self.layer_clock.lap(layer.layer)

    def _try_table(self, streams, rows, head) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The step against the store's slot table: its streams and head, or None (state as before)
        when an expert was missing. The previous step's accounting is done while this one's graphs
        run."""
        if not self.speculation.due():
            return None
        table = self.tabled.hold_slot_table()
        try:
            streams = self._through_table(streams, table, rows)
        finally:
            self.tabled.release_slot_table()
        out = streams, head(streams)
        self.settle()
        report = self._report.tolist()  # the one read-back
        confirmed = not any(row[0] for row in report)
        self.speculation.record(confirmed)
        if not confirmed:
            for live, saved in self._saved:
                live.copy_(saved)
            return None
        with self._settling:
            self._unrecorded = report
        return out

    def settle(self) -> None:
        """Hand the store what the last step from the slot table used. A step's accounting waits
        for the next step's graphs to be launched, so the GPU does not idle through it; call this
        before reading the store's counters or `staging`."""
        with self._settling:  # a server's metrics thread may settle while the engine's thread steps
            if self._unrecorded is not None:
                self._record(self._unrecorded)
                self._unrecorded = None

    def _record(self, report: list[list[int]]) -> None:
        self.tabled.record_step(count_step(self.layers, report, self.staging, self._predicts))

    def _through_store(self, streams, rows) -> torch.Tensor:
        self.settle()  # the store sees the steps in order
        self._begin_laps()
        carried = ()  # the previous layer's (routed and shared experts' outputs, inject), combined next
        for layer, call in self._store_pieces:
            streams, x, inject, weights, experts, shared, predicted, *far = call(
                streams, self._position, *carried, *self._rows_of([layer], rows))
            carried = (self.experts.from_store(layer.layer, x, weights, experts, predicted, *far), shared, inject)
            self._lap(layer)
        streams = self.combine(self.layers[-1], streams, *carried)
        self._lap(self.layers[-1])  # its experts' combine, which no next piece does
        return streams

    @staticmethod
    def _rows_of(layers: list[DecoderLayer], rows: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        return [rows[layer.layer] for layer in layers if layer.ple is not None]

    def _layer_front(self, layer: DecoderLayer, streams, position, ple_rows):
        ple_state = self._state.ple[layer.layer] if layer.ple is not None else None
        mixer_state = self._state.deltanet[layer.layer] if layer.linear else self._state.attention[layer.layer]
        return self.front(layer, streams, position, ple_rows, ple_state, mixer_state)

    def _table_piece(self, first: int, count: int, bank, host: HostRecords | None) -> Callable:
        """Layers first .. first + count - 1 against a slot table [layers, experts]: (table,
        position, streams, [their PLE rows,] [the layer before's prediction of the first one's
        experts: ids, and with staging rows the offsets of those in the host cache and their bank
        rows]) -> (streams, [the last layer's prediction of the next one's, as handed on]). The
        step's first layer saves the state a redo restores; against a store's table, each layer
        writes its row of the step's report: whether an expert was on disk, how many records were staged
        ahead for it, how many of its experts the layer before predicted; then its expert ids,
        their codes, and which came staged ahead."""
        def piece(table, position, streams, *rest):
            if first == 0:
                for live, saved in self._saved:
                    saved.copy_(live)
            rest = list(rest)
            ple_rows = {layer.layer: rest.pop(0) for layer in self.layers[first:first + count] if layer.ple is not None}
            carried, staged = tuple(rest), False
            for index in range(first, first + count):
                streams, carried, staged = self._table_layer(index, table, position, streams, ple_rows, carried,
                                                             staged, bank, host, last=index == first + count - 1)
            return (streams, *carried)

        return piece

    def _table_layer(self, index: int, table, position, streams, ple_rows, carried, staged: bool, bank, host,
                     last: bool):
        """One layer of a table piece: (streams, what it hands the next layer, whether its records
        are already staging). `carried`: the layer before's prediction of this layer's experts, with
        staging rows the offsets of those in the host cache and their bank rows; `staged`: the layer
        before, in the same graph, started staging them already."""
        layer = self.layers[index]
        guess, ahead = (carried[0] if carried else None), None  # the layer before's prediction
        if len(carried) == 3:  # the predicted host experts cross beside this layer's work up to its experts
            offsets, rows = carried[1:]
            if not staged:
                self._stage_ahead(host, offsets, index)
            ahead = (guess, rows)
        streams = self._layer_front(layer, streams, position, ple_rows.get(layer.layer))
        x, inject, weights, experts, shared, predicted = self.route(layer, self._next_moe[layer.layer], streams)
        if self.resident:  # every expert in a device slot: nothing to stage, nothing missing, no report
            slots = table[layer.layer][experts]
        else:
            slots, weights, codes, missing, early = self.table_slots(experts, weights, table[layer.layer], host, ahead)
            self._report[index].copy_(report_row(experts, codes, missing, early, guess, ahead))
        if ahead is not None:
            self._join_side()  # the records staged ahead for this layer have landed
        forked = False
        if predicted is None or host is None:
            handed, staging = (() if predicted is None else (predicted,)), False
        else:
            # the next layer's records start crossing now, beside this layer's experts (they land in
            # the other ahead row set): all of them when the next layer is in this graph (beside its
            # work up to its experts too); when it starts the next graph, the first
            # `staged_beside_experts`, and that graph stages the rest, since this one's end waits for
            # what it forks
            crossing_now = self.staged_beside_experts if last else layer.moe.top_k
            now, later, rows = self.ahead_offsets(predicted, table[layer.layer + 1], host,
                                                  ahead_rows(index + 1), crossing_now)
            forked = crossing_now > 0
            if forked:
                self._stage_ahead(host, now, index + 1)
            handed, staging = (predicted, later, rows), not last
        streams = self.combine(layer, streams, moe_experts(x, bank, slots, weights), shared, inject)
        if last and forked:
            self._join_side()
        return streams, handed, staging

    def _stage_ahead(self, host: HostRecords, offsets: torch.Tensor, index: int) -> None:
        """Stage layer `index`'s predicted host records (`offsets`, -1: none) into its ahead rows on
        the side stream. `offsets` stays referenced (carried) until the layer's join, so the
        allocator cannot hand its memory to other work while the side stream reads it."""
        self._beside(lambda: stage_records(host.source, offsets, host.rows(ahead_rows(index)),
                                           programs=self.staging_programs))

    def _beside(self, work: Callable[[], object]) -> None:
        """Enqueue `work` on the side stream, after what the current stream has enqueued (inline
        without a side stream: on a CPU)."""
        if self._side is None:
            work()
            return
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            work()

    def _join_side(self) -> None:
        if self._side is not None:
            torch.cuda.current_stream().wait_stream(self._side)

    def _store_layer(self, layer: DecoderLayer, previous: DecoderLayer | None) -> Callable:
        """(streams, MoE input, its inject, routing weights, expert ids, shared expert output,
        next layer's predicted ids or None[, the layer after's]), the previous layer's experts
        combined first."""
        def step(streams, position, *rest):
            if previous is not None:
                routed, shared, inject, *rest = rest
                streams = self.combine(previous, streams, routed, shared, inject)
            streams = self._layer_front(layer, streams, position, rest[0] if rest else None)
            routed_inputs = self.route(layer, self._next_moe[layer.layer], streams)
            far = self.experts.predict_far(layer.layer, routed_inputs[0])
            return (streams, *routed_inputs, *([] if far is None else [far]))

        return step

    def _bind(self, state: SequenceState, device: torch.device) -> None:
        live = [t for s in state.deltanet.values() for t in (s.conv, s.recurrent)]
        live += [s.conv for s in state.ple.values()]
        key = tuple(t.data_ptr() for t in live)
        key += tuple(state.attention[layer.layer].buffers()[0].data_ptr() for layer in self.layers if not layer.linear)
        if key == self._bound_to:
            return
        self._bound_to = key
        make_table_call = make_store_call = self.make_call
        if self.make_call is None:
            table_pool, store_pool = torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle()
            make_table_call = lambda fn, kept: CapturedCall(fn, table_pool, kept)  # noqa: E731
            make_store_call = lambda fn, kept: CapturedCall(fn, store_pool, kept)  # noqa: E731
        self._position = torch.zeros(1, dtype=torch.int64, device=device)
        # the store's pieces: (streams, position, [previous experts' output, inject,] [PLE rows])
        previous = [None, *self.layers[:-1]]
        self._store_pieces = [] if self.resident else [
            (layer, make_store_call(self._store_layer(layer, before), kept=(1,)))
            for layer, before in zip(self.layers, previous)]
        self._table_pieces = []
        if self.resident:
            bank, host = self.experts.source.bank, None
        elif self.tabled is not None:
            bank, host = self.tabled.bank, self.tabled.host_records
            if host is not None and host.staging.is_cuda and self._side is None:
                self._side = torch.cuda.Stream(host.staging.device)
            self._saved = [(t, t.clone()) for t in live]
            k = self.layers[0].moe.top_k
            self._report = torch.zeros(len(self.layers), 3 + 3 * k, dtype=torch.int32, device=device)
        else:
            return
        for first in range(0, len(self.layers), self.layers_per_graph):
            layers = self.layers[first:first + self.layers_per_graph]
            # (table, position, streams, [PLE rows,] [carried]): all but the first piece's streams
            # and the PLE rows are the same tensors every step
            ple = sum(layer.ple is not None for layer in layers)
            kept = {0, 1} | ({2} if first else set()) | set(range(3 + ple, 3 + ple + 3))
            call = make_table_call(self._table_piece(first, len(layers), bank, host), kept=kept)
            self._table_pieces.append((layers, call))
