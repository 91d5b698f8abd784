"""A pack as the engine's WeightSource and ExpertFetcher: dense tensors, PLE rows and experts,
decoded from the memory-mapped pack on demand.

This is the plain, all-from-page-cache path; the tiered store puts VRAM and pinned-RAM caches and
O_DIRECT reads behind the same `ExpertFetcher` call.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from flashpack.errors import FlashpackError
from flashpack.layout.model_config import TextConfig
from flashpack.layout.nvfp4 import dequantize_fp8_rows
from flashpack.layout.pack import Pack
from flashpack.layout.records import PROJECTIONS
from flashpack.runtime.experts import ExpertWeights


class PackWeights:
    """Dense tensors (FP8 rows dequantised) and PLE rows straight from the pack."""

    def __init__(self, pack: Pack):
        self.pack = pack
        self.config: TextConfig = pack.manifest.config
        self._entries = pack.manifest.dense_tensors()
        self._ple_tables = {table.ple_index: table for table in pack.manifest.ple_tables()}

    def dense(self, name: str) -> torch.Tensor:
        entry = self._entries.get(name)
        if entry is None:
            raise FlashpackError(f"pack has no dense tensor {name}")
        stored = self.pack.dense_tensor(name)
        if entry.row_scale is None:
            return stored
        return dequantize_fp8_rows(stored, self.pack.dense_tensor(entry.row_scale))

    def dense_fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The FP8 values and float32 row scales of a tensor the pack stores as FP8 rows, else None."""
        entry = self._entries.get(name)
        if entry is None or entry.row_scale is None:
            return None
        return self.pack.dense_tensor(name), self.pack.dense_tensor(entry.row_scale).float()

    def ple_rows(self, ple_index: int, rows: torch.Tensor) -> torch.Tensor:
        return self.pack.ple_rows(self._ple_tables[ple_index], rows)


class PackExperts:
    """Experts decoded from the pack's records (hash-checked on first read) and dequantised.

    Decoding a record costs far more than using it (on the demo model a layer's 4 experts take
    1.4 ms to decode against 0.1 ms for their products), so up to `cache_bytes` of dequantised
    experts are kept, least recently used dropped first; 0 decodes on every fetch. The weights
    handed out are never written to, so a cached expert is shared as it is."""

    def __init__(self, pack: Pack, verify_records: bool = True, cache_bytes: int = 0):
        self.pack = pack
        self.verify_records = verify_records
        self.cache_bytes = cache_bytes
        self._cached: OrderedDict[tuple[int, int], ExpertWeights] = OrderedDict()
        self._held = 0

    def fetch(self, layer: int, experts: list[int]) -> dict[int, ExpertWeights]:
        fetched = {}
        for expert in experts:
            weights = self._cached.get((layer, expert))
            if weights is None:
                decoded = self.pack.expert(layer, expert, verify=self.verify_records)
                weights = ExpertWeights(*(decoded.dequantize(p) for p in PROJECTIONS))
                self._keep((layer, expert), weights)
            else:
                self._cached.move_to_end((layer, expert))
            fetched[expert] = weights
        return fetched

    def _keep(self, key: tuple[int, int], weights: ExpertWeights) -> None:
        size = _nbytes(weights)
        if size > self.cache_bytes:
            return
        while self._held + size > self.cache_bytes:
            _, dropped = self._cached.popitem(last=False)
            self._held -= _nbytes(dropped)
        self._cached[key] = weights
        self._held += size


def _nbytes(weights: ExpertWeights) -> int:
    return sum(getattr(weights, p).nbytes for p in PROJECTIONS)
