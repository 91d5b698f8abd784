"""Open a pack: its manifest, its files memory-mapped, and checked reads of records and rows.

Opening refuses a pack whose files are missing or of the wrong size, so a damaged pack fails at
start with one line instead of mid-generation. Reads here are the plain (page-cache) path; the
runtime's tiered store does its own O_DIRECT reads from the same offsets.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from flashpack.errors import FlashpackError
from flashpack.layout.dtypes import TORCH_DTYPES
from flashpack.layout.manifest import ExpertRecordEntry, Manifest, PleTable
from flashpack.layout.records import DecodedExpert, decode_record, record_hash


@dataclass
class Pack:
    root: Path
    manifest: Manifest
    _maps: dict[str, mmap.mmap] = field(default_factory=dict, repr=False)
    _records: dict[tuple[int, int], ExpertRecordEntry] = field(default_factory=dict, repr=False)
    _verified: set[tuple[int, int]] = field(default_factory=set, repr=False)
    _ple_arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # uint8 [rows, row_stride] views

    @classmethod
    def open(cls, root: Path | str) -> "Pack":
        root = Path(root)
        if not root.is_dir():
            raise FlashpackError(f"pack {root} does not exist")
        manifest = Manifest.load(root)
        for entry in manifest.files():
            path = root / entry["path"]
            if not path.is_file():
                raise FlashpackError(f"pack file {entry['path']} is missing from {root}")
            size = path.stat().st_size
            if size != entry["bytes"]:
                raise FlashpackError(f"pack file {entry['path']} is {size} bytes, the manifest says {entry['bytes']}")
        pack = cls(root, manifest)
        pack._records = {(r.layer, r.expert): r for r in manifest.expert_records()}
        return pack

    def close(self) -> None:
        self._ple_arrays.clear()  # the views export the maps' buffers, which must go before a map closes
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()

    def file_map(self, relative: str) -> mmap.mmap:
        if relative not in self._maps:
            with open(self.root / relative, "rb") as handle:
                mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            # Lookups are scattered: read-ahead would drag in pages nobody asked for.
            mapping.madvise(mmap.MADV_RANDOM)
            self._maps[relative] = mapping
        return self._maps[relative]

    def record_entry(self, layer: int, expert: int) -> ExpertRecordEntry:
        try:
            return self._records[(layer, expert)]
        except KeyError:
            raise FlashpackError(f"pack has no record for layer {layer} expert {expert}") from None

    def record_bytes(self, layer: int, expert: int, verify: bool = True) -> memoryview:
        """The record's bytes (a view of the mapped file); hashed the first time when `verify`."""
        entry = self.record_entry(layer, expert)
        view = memoryview(self.file_map(entry.file))[entry.offset:entry.offset + entry.length]
        if verify and (layer, expert) not in self._verified:
            if record_hash(view) != entry.xxh64:
                raise FlashpackError(f"corrupt expert record: layer {layer} expert {expert} fails its xxh64 check")
            self._verified.add((layer, expert))
        return view

    def expert(self, layer: int, expert: int, verify: bool = True) -> DecodedExpert:
        view = self.record_bytes(layer, expert, verify)
        buffer = torch.frombuffer(bytearray(view), dtype=torch.uint8)
        return decode_record(self.manifest.geometry, buffer, where=f"layer {layer} expert {expert}")

    def ple_rows(self, table: PleTable, rows: torch.Tensor) -> torch.Tensor:
        """int64 [n] row ids -> float32 [n, dim], dequantised. A decode step reads one row per hash
        head, so this stays in numpy until the last moment: a dozen torch ops would cost more."""
        ids = rows.cpu().numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= table.rows):
            raise FlashpackError(f"PLE row out of range for layer {table.layer} ({table.rows} rows)")
        data = self._ple_arrays.get(table.file)
        if data is None:
            data = np.frombuffer(self.file_map(table.file), dtype=np.uint8).reshape(table.rows, table.row_stride)
            self._ple_arrays[table.file] = data
        picked = data[ids]
        scales = np.ascontiguousarray(picked[:, table.dim:table.dim + 4]).view(np.float32)  # [n, 1]
        values = torch.from_numpy(picked[:, :table.dim]).view(torch.float8_e4m3fn).float()
        return values.mul_(torch.from_numpy(scales))

    def dense_tensor(self, name: str) -> torch.Tensor:
        """A dense tensor as stored (BF16, or FP8 values; see `dense_row_scale`)."""
        entry = self.manifest.dense_tensors().get(name)
        if entry is None:
            raise FlashpackError(f"pack has no dense tensor {name}")
        return _tensor_from_map(self.file_map(self.manifest.document["dense"]["file"]), entry)


def _tensor_from_map(mapping: mmap.mmap, entry) -> torch.Tensor:
    raw = bytearray(mapping[entry.offset:entry.offset + entry.length])
    return torch.frombuffer(raw, dtype=torch.uint8).view(TORCH_DTYPES[entry.dtype]).reshape(entry.shape)
