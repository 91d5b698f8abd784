"""How the MoE block gets routed experts: as dequantised weights, or as rows of a device bank.

Two kinds of source sit behind a MoE block; the block asks which one it has:

    ExpertFetcher.fetch(layer, experts) -> {expert: ExpertWeights}
        dequantised [out, in] tensors; the plain path (pack decoded on demand, the tests'
        in-memory experts). The block runs them as ordinary linears.
    ExpertSlots.stream(layer, experts) -> lists of ready handles (.expert, .slot)
        the records' own NVFP4 bytes, resident in rows of `ExpertSlots.bank` on the engine's
        device; the block runs the fused kernels (runtime/kernels) over them.
    ResidentSlots.slot_table[layer, expert] -> slot
        an ExpertSlots source that holds every expert for good (an unbounded budget): the block
        looks slots up on the device, with no host round trip, which CUDA graphs need.
    TabledSlots.hold_slot_table()[layer, expert] -> code
        an ExpertSlots source whose experts come and go (the tiered store) that also says on the
        device where each one is now:
            code >= 0     its device slot (bank row)
            code <= -2    host-cache slot -(code + 2): `host_records` lets the step copy it into a
                          staging row of the bank itself
            code == -1    only on disk (or still being read or copied): the step is redone
                          through `stream`

Whatever tiers sit behind a source (device slots, pinned host cache, disk reads) are invisible
here. MTP layers use layer index num_hidden_layers + mtp_layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch

from flashpack.runtime.kernels.bank import ExpertBank

ON_DISK = -1  # a slot-table code (TabledSlots)


def host_code(host_slot: int) -> int:
    """The slot-table code of host-cache slot `host_slot`."""
    return -(host_slot + 2)


def host_slot_of(code):
    """The host-cache slot a slot-table code <= -2 names (ints or tensors)."""
    return -code - 2


LATE_ROWS = 0  # HostRecords' staging row sets: this one, then the two of `ahead_rows` (3 in all:
# runtime/store/budget.py's STAGING_ROW_SETS)


def ahead_rows(layer: int) -> int:
    """The staging row set a layer's predicted experts are staged into: even and odd layers take
    turns, so the next layer's records may cross while this layer's experts still read its own."""
    return 1 + layer % 2


@dataclass(frozen=True)
class HostRecords:
    """What a decode step needs to stage host-cache records into device rows itself. The staging
    rows come in sets of top_k: LATE_ROWS takes a layer's host experts once its router has picked
    them, `ahead_rows(layer)` those the layer before predicted, staged while the layer computes up
    to its experts (or, inside a graph of several layers, from the layer before's route on)."""

    source: torch.Tensor  # int32 view of the host pool's lowest chunk: the base every address counts from
    offsets: torch.Tensor  # int64 [host slots] on the device: each host slot's offset from `source`, in words
    staging: torch.Tensor  # int32 [sets * top_k, stride / 4]: the device pool's staging rows
    first_staging_slot: int  # the bank row of staging[0]
    top_k: int

    def rows(self, row_set: int) -> torch.Tensor:
        """int32 [top_k, stride / 4]: staging row set `row_set`."""
        return self.staging[row_set * self.top_k:(row_set + 1) * self.top_k]

    def first_slot(self, row_set: int) -> int:
        """The bank row of set `row_set`'s first row."""
        return self.first_staging_slot + row_set * self.top_k


@dataclass
class ExpertWeights:
    """One expert, dequantised, [out, in] like nn.Linear: gate, up [I, H]; down [H, I]."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@runtime_checkable
class ExpertFetcher(Protocol):
    def fetch(self, layer: int, experts: list[int]) -> dict[int, ExpertWeights]:
        """Weights of `experts` (ascending, unique) of decoder `layer`; every id must be in the result."""
        ...


class SlotHandle(Protocol):
    expert: int
    slot: int  # row of the source's bank


@runtime_checkable
class ExpertSlots(Protocol):
    @property
    def bank(self) -> ExpertBank:
        """Every slot of the source as one bank on the engine's device."""
        ...

    def stream(
        self, layer: int, experts: list[int], prefetch_after: tuple[int, list[int]] | None = None,
        read_ahead: tuple[int, list[int]] | None = None,
    ) -> Iterator[list[SlotHandle]]:
        """Ready handles covering `experts` of `layer` once each, in one or more chunks; a chunk's
        slots stay valid until the consumer asks for the next chunk (kernels enqueued by then).
        `prefetch_after`: (layer, experts) to prefetch once this request's loads have started,
        before the first chunk is waited for; `read_ahead`: (layer, experts) a layer further on is
        expected to ask for, whose records on disk to start reading then too."""
        ...

    def prefetch(self, layer: int, experts: list[int]) -> int:
        """Start loading `experts` for a request expected soon; never blocks. Returns loads started."""
        ...


@runtime_checkable
class ResidentSlots(ExpertSlots, Protocol):
    @property
    def slot_table(self) -> torch.Tensor:
        """int32 [layers, num_experts]: the slot of every expert, on the device."""
        ...

    def record_use(self, layer: int, experts: torch.Tensor) -> None:
        """Count a forward's requests (expert ids [T, k] on the device) in the source's stats."""
        ...

    def count_replay(self, layer: int) -> None:
        """Count one token's requests of `layer` for a MoE block replayed from a CUDA graph."""
        ...


@runtime_checkable
class TabledSlots(ExpertSlots, Protocol):
    def hold_slot_table(self) -> torch.Tensor:
        """int32 [layers, num_experts] on the device: where each expert is now (slot_table.py: a
        device slot, a host slot, or on disk). Those slots keep their bytes until
        `release_slot_table`, and on CUDA until the work enqueued before it has run."""
        ...

    def release_slot_table(self) -> None:
        """The work that reads the held table's slots is enqueued (on the current stream)."""
        ...

    @property
    def host_records(self):
        """A slot_table.HostRecords when the table also names host-cache slots (codes <= -2) for
        the step to stage into device rows itself; None when it names device slots alone."""
        ...

    def record_step(self, found: list[tuple[int, list[int], list[int], int]]) -> None:
        """Count what a decode step found through the table: (layer, experts on the device,
        experts staged from the host cache, records staged for it that it did not use) for each
        layer."""
        ...
