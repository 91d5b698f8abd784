"""`ResidentExperts`: every expert record of the pack in one device tensor, for good.

What the tiered store becomes when the device budget holds every record (an unbounded budget, or
a card larger than the experts): no eviction, no host round trip per layer. The records are
read once at start, in file order, at disk speed (bulk_read.py: O_DIRECT batches on several
threads, each record checked against its xxh64 by the thread that read it), and laid out as rows of
one uint8 [records, stride] pool; `slot_table[layer, expert]` gives the
row on the device, so the MoE block looks slots up without leaving the GPU (and can be captured
in a CUDA graph). Stats count the load as pre-warming: every request afterwards is a device hit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch
from tqdm import tqdm

from flashpack.errors import FlashpackError
from flashpack.layout.pack import Pack
from flashpack.runtime.kernels.bank import ExpertBank
from flashpack.runtime.store.budget import StorePlan, served_records
from flashpack.runtime.store.bulk_read import READ_THREADS, RecordBatch, read_records_in_batches
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.store.reader import RecordReader
from flashpack.runtime.store.stats import StoreStats


class ResidentHandle:
    __slots__ = ("expert", "slot")

    def __init__(self, expert: int, slot: int):
        self.expert, self.slot = expert, slot


class ResidentExperts:
    def __init__(
        self, pack: Pack, device: torch.device | str, config: StoreConfig = StoreConfig(), progress: bool = True,
        plan: StorePlan | None = None, layers: list[int] | None = None,
    ):
        """`config`: its direct_io, verify_records and read_pieces say how the records are read;
        `layers`: the layers whose experts it loads (default: every layer with records)."""
        self.pack, self.device, self.plan = pack, torch.device(device), plan  # plan: the budget it came from
        self.config = config
        manifest = pack.manifest
        self.geometry = manifest.geometry
        stride = manifest.document["experts"]["record_stride"]
        records = sorted(served_records(pack, layers), key=lambda r: (r.file, r.offset))
        layers = max(r.layer for r in records) + 1
        self.stats = StoreStats()
        # a prompt's distinct experts a layer, counted on the device: (layer, the count copied to the
        # host, its event), added to the stats by the engine's thread once the copy has landed
        self._counting: deque[tuple[int, torch.Tensor, torch.cuda.Event]] = deque()
        self.pool = torch.empty((len(records), stride), dtype=torch.uint8, device=self.device)
        cfg = manifest.config  # parsed from the manifest on every access: read it once
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.num_experts
        table = torch.full((layers, cfg.num_experts), -1, dtype=torch.int32)
        self._slots: dict[tuple[int, int], int] = {}
        bar = tqdm(total=len(records) * stride, unit="B", unit_scale=True, desc="loading experts",
                   disable=not progress, leave=False)

        def place(batch: RecordBatch, rows: torch.Tensor) -> None:
            for row, record in enumerate(batch.records, start=batch.first_row):
                table[record.layer, record.expert] = row
                self._slots[(record.layer, record.expert)] = row
                self.stats.bump(record.layer, prewarmed_device=1, prewarm_bytes_disk_to_host=stride,
                                prewarm_bytes_host_to_device=stride)
            self.pool[batch.first_row:batch.first_row + len(batch.records)].copy_(rows)  # synchronous: rows are reused
            bar.update(len(batch.records) * stride)

        reader = RecordReader(pack.root, sorted({r.file for r in records}), direct=config.direct_io,
                              pieces=config.read_pieces, callers=READ_THREADS)
        try:
            read_records_in_batches(reader, records, stride, place, verify=config.verify_records,
                                    pin=self.device.type == "cuda")
        finally:
            reader.close()
            bar.close()
        self.read_fallback = reader.fallback_reason
        self.stats.verified_records = len(records) if config.verify_records else 0
        self._table = table.to(self.device)
        self._bank = ExpertBank.from_pool(self.pool, self.geometry)

    @property
    def bank(self) -> ExpertBank:
        return self._bank

    @property
    def slot_table(self) -> torch.Tensor:
        return self._table

    def record_use(self, layer: int, experts: torch.Tensor) -> None:
        """Count a forward's expert requests (all device hits). One token's top-k are distinct, so
        decode counts without reading anything back; a prompt counts its distinct experts. On a
        GPU that count is copied back without waiting (a wait a MoE layer holds the host while the
        GPU drains, in a prompt whose launches are most of its time) and reaches the stats at the next
        count after it has landed. Nothing is counted while a CUDA graph is captured: the graph runner counts
        its replays."""
        if experts.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        self._settle()
        if experts.shape[0] == 1:
            self.stats.bump(layer, requests=experts.shape[1], device_hits=experts.shape[1])
        elif not experts.is_cuda:
            used = int(torch.unique(experts).numel())
            self.stats.bump(layer, requests=used, device_hits=used)
        else:
            seen = torch.zeros(self.num_experts, dtype=torch.bool, device=experts.device)
            # index_fill_ takes True as a scalar argument: `seen[ids] = True` copies it to the device
            # from pageable memory first, a wait for the GPU in every MoE layer of a prompt
            seen.index_fill_(0, experts.flatten().long(), True)
            landed = torch.cuda.Event()
            count = seen.sum().to("cpu", non_blocking=True)
            landed.record()
            self._counting.append((layer, count, landed))

    def count_replay(self, layer: int) -> None:
        """One decode token's requests of `layer`, for a MoE block replayed from a CUDA graph."""
        self._settle()
        self.stats.bump(layer, requests=self.top_k, device_hits=self.top_k)

    def _settle(self) -> None:
        """The landed counts into the stats: on the engine's thread, between captures (a server's
        metrics thread reads the stats, a forward late at most, and never touches the device)."""
        while self._counting and self._counting[0][2].query():
            layer, count, _ = self._counting.popleft()
            used = int(count)
            self.stats.bump(layer, requests=used, device_hits=used)

    def stream(self, layer: int, experts: list[int], prefetch_after=None,
               read_ahead=None) -> Iterator[list[ResidentHandle]]:
        """Every expert at once; `prefetch_after` and `read_ahead` have nothing to load."""
        try:
            yield [ResidentHandle(expert, self._slots[(layer, expert)]) for expert in experts]
        except KeyError as missing:
            raise FlashpackError(f"pack has no record for layer {layer} expert {missing.args[0][1]}") from None

    def prefetch(self, layer: int, experts: list[int]) -> int:
        return 0  # everything is resident

    def close(self) -> None:
        self.pool = self._bank = None
