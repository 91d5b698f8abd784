"""Open a pack: its manifest, its files memory-mapped, and checked reads of records, rows and tensors.

Opening refuses, with one line, a pack whose manifest fails its schema or its own hash, whose files
are missing or of the wrong size, whose numbers contradict each other or the files
(layout/consistency.py), or whose tokenizer files or block digest files fail their hashes, so a
damaged pack fails at start instead of mid-generation or with different output. The larger parts
are checked as they are read, each hashed block once: a dense tensor's 1 MiB blocks when the
tensor is read (the engine reads every dense tensor it uses while it loads, so `load_engine`
checks them all), a PLE page the first time a row in it is read, an expert record the first time
it is read. Reads here are
the plain (page-cache) path; the runtime's tiered store does its own O_DIRECT reads of records.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from flashpack.errors import FlashpackError, PackDamageError
from flashpack.layout.block_contents import block_contents
from flashpack.layout.checksums import DIGEST, DIGESTS_ROLE, BlockChecker, hash_file, xxh64_hex
from flashpack.layout.consistency import consistency_problems
from flashpack.layout.dtypes import TORCH_DTYPES
from flashpack.layout.manifest import ExpertRecordEntry, Manifest, PleTable, TensorEntry
from flashpack.layout.records import DecodedExpert, decode_record, record_hash


def missing_or_resized(root: Path, manifest: Manifest) -> list[str]:
    """One line per file of the manifest that is missing or whose size differs."""
    problems = []
    for entry in manifest.files():
        path = root / entry["path"]
        if not path.is_file():
            problems.append(f"pack file {entry['path']} is missing from {root}")
        elif (size := path.stat().st_size) != entry["bytes"]:
            problems.append(f"pack file {entry['path']} is {size} bytes, the manifest says {entry['bytes']}")
    return problems


def _refuse(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more problems: flashpack inspect --check lists them)" if len(problems) > 1 else ""
        raise PackDamageError(problems[0] + more)


@dataclass
class Pack:
    root: Path
    manifest: Manifest
    _maps: dict[str, mmap.mmap] = field(default_factory=dict, repr=False)
    _records: dict[tuple[int, int], ExpertRecordEntry] = field(default_factory=dict, repr=False)
    _verified: set[tuple[int, int]] = field(default_factory=set, repr=False)
    _ple_arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # uint8 [rows, row_stride] views
    _block_checkers: dict[str, BlockChecker] = field(default_factory=dict, repr=False)
    _dense: dict[str, TensorEntry] = field(default_factory=dict, repr=False)
    _digests: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # digest file -> uint64 [blocks]

    def __post_init__(self) -> None:
        self._records = {(r.layer, r.expert): r for r in self.manifest.expert_records()}
        self._dense = self.manifest.dense_tensors()  # built once: the engine reads thousands of tensors

    @classmethod
    def open(cls, root: Path | str) -> "Pack":
        root = Path(root)
        if not root.is_dir():
            raise FlashpackError(f"pack {root} does not exist")
        manifest = Manifest.load(root)
        _refuse(missing_or_resized(root, manifest))
        _refuse(consistency_problems(manifest, root))
        pack = cls(root, manifest)
        _refuse(pack._check_whole_files())
        return pack

    def _check_whole_files(self) -> list[str]:
        """Hash the files read whole at open, one line per failure, and keep the block digests:
        the tokenizer files and chat template (the tokenizer reads them itself; ~10 MB for the
        real model) and the block digest files (~0.1 GB for the real model, most of it PLE's)."""
        problems = []
        for entry in self.manifest.files():
            if entry["role"] == DIGESTS_ROLE:
                data = (self.root / entry["path"]).read_bytes()
                intact = xxh64_hex(data) == entry["xxh64"]
                if intact:
                    self._digests[entry["path"]] = np.frombuffer(data, dtype=DIGEST)
            elif entry["role"] == "tokenizer":
                intact = hash_file(self.root / entry["path"]).xxh64 == entry["xxh64"]
            else:
                continue
            if not intact:
                problems.append(f"pack damaged: {entry['path']} fails its xxh64 check")
        return problems

    def close(self) -> None:
        # The PLE views and the checkers' memoryviews export the maps' buffers: they go first.
        self._ple_arrays.clear()
        for checker in self._block_checkers.values():
            checker.release()
        self._block_checkers.clear()
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
                raise PackDamageError(f"corrupt expert record: layer {layer} expert {expert} fails its xxh64 check")
            self._verified.add((layer, expert))
        return view

    def expert(self, layer: int, expert: int, verify: bool = True) -> DecodedExpert:
        view = self.record_bytes(layer, expert, verify)
        buffer = torch.frombuffer(bytearray(view), dtype=torch.uint8)
        return decode_record(self.manifest.geometry, buffer, where=f"layer {layer} expert {expert}")

    def block_checker(self, relative: str) -> BlockChecker:
        """The block checker of a block-hashed file (dense, vision, PLE), made on first use."""
        checker = self._block_checkers.get(relative)
        if checker is None:
            entry = self.manifest.file_entry(relative)
            if entry is None or entry.get("block_digests") not in self._digests:
                raise PackDamageError(f"pack damaged: {relative} has no checked block digests")
            describe = block_contents(self.manifest, relative, entry["block_bytes"])
            checker = BlockChecker(relative, self.file_map(relative), entry["block_bytes"],
                                   self._digests[entry["block_digests"]], describe)
            self._block_checkers[relative] = checker
        return checker

    def ple_rows(self, table: PleTable, rows: torch.Tensor) -> torch.Tensor:
        """int64 [n] row ids -> float32 [n, dim], dequantised; the blocks holding the rows are
        hash-checked the first time any row in them is read. A decode step reads one row per hash
        head, so this stays in numpy until the last moment: a dozen torch ops would cost more."""
        ids = rows.cpu().numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= table.rows):
            raise FlashpackError(f"PLE row out of range for layer {table.layer} ({table.rows} rows)")
        data = self._ple_arrays.get(table.file)
        if data is None:
            data = np.frombuffer(self.file_map(table.file), dtype=np.uint8).reshape(table.rows, table.row_stride)
            self._ple_arrays[table.file] = data
        checker = self.block_checker(table.file)
        starts = ids * table.row_stride
        checker.check_blocks(np.concatenate([starts, starts + (table.row_stride - 1)]) // checker.block_bytes)
        picked = data[ids]
        scales = np.ascontiguousarray(picked[:, table.dim:table.dim + 4]).view(np.float32)  # [n, 1]
        values = torch.from_numpy(picked[:, :table.dim]).view(torch.float8_e4m3fn).float()
        return values.mul_(torch.from_numpy(scales))

    def dense_tensor(self, name: str) -> torch.Tensor:
        """A dense tensor as stored (BF16, or FP8 values; see `dense_row_scale`), its blocks
        hash-checked the first time they are read."""
        entry = self._dense.get(name)
        if entry is None:
            raise FlashpackError(f"pack has no dense tensor {name}")
        file = self.manifest.document["dense"]["file"]
        self.block_checker(file).check_range(entry.offset, entry.offset + entry.length, reading=name)
        return _tensor_from_map(self.file_map(file), entry)


def _tensor_from_map(mapping: mmap.mmap, entry) -> torch.Tensor:
    raw = bytearray(mapping[entry.offset:entry.offset + entry.length])
    return torch.frombuffer(raw, dtype=torch.uint8).view(TORCH_DTYPES[entry.dtype]).reshape(entry.shape)
