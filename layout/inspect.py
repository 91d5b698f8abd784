"""What a pack holds (sizes per part, record counts, expert bytes per token) and whether its records
are intact (layout/integrity.py checks every other byte too)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tqdm import tqdm

from flashpack.layout.manifest import ExpertRecordEntry
from flashpack.layout.pack import Pack
from flashpack.layout.records import record_hash


@dataclass(frozen=True)
class PackSummary:
    bytes_by_role: dict[str, int]
    expert_records: int
    expert_layers: int
    record_bytes: int
    record_stride: int
    expert_bytes_per_token: int  # top-k records for every decoder layer, batch 1
    ple_tables: int
    ple_rows: int
    dense_tensors: int
    source_quantization: str
    hot_sets: list[str]

    def lines(self) -> list[str]:
        gib = 2**30
        out = [f"source quantization   {self.source_quantization}"]
        for role, size in sorted(self.bytes_by_role.items()):
            out.append(f"{role:<21} {size / gib:10.3f} GiB")
        out += [
            f"expert records        {self.expert_records} in {self.expert_layers} layers, "
            f"{self.record_bytes} bytes each ({self.record_stride // 4096} pages)",
            f"expert bytes/token    {self.expert_bytes_per_token / 2**20:.2f} MiB (top-k x decoder layers)",
            f"ple tables            {self.ple_tables} ({self.ple_rows} rows)",
            f"dense tensors         {self.dense_tensors}",
            f"hot sets              {', '.join(self.hot_sets) or '(none)'}",
        ]
        return out


def summarize(pack: Pack) -> PackSummary:
    manifest = pack.manifest
    cfg = manifest.config
    by_role: dict[str, int] = defaultdict(int)
    for entry in manifest.files():
        by_role[entry["role"]] += entry["bytes"]
    records = manifest.expert_records()
    experts = manifest.document["experts"]
    return PackSummary(
        bytes_by_role=dict(by_role),
        expert_records=len(records),
        expert_layers=len({r.layer for r in records}),
        record_bytes=experts["record_bytes"],
        record_stride=experts["record_stride"],
        expert_bytes_per_token=cfg.num_experts_per_tok * cfg.num_hidden_layers * experts["record_bytes"],
        ple_tables=len(manifest.ple_tables()),
        ple_rows=sum(t.rows for t in manifest.ple_tables()),
        dense_tensors=len(manifest.dense_tensors()),
        source_quantization=manifest.document["source"]["quantization"],
        hot_sets=sorted(manifest.hot_sets),
    )


def find_corrupt_records(pack: Pack, progress: bool = True,
                         records: list[ExpertRecordEntry] | None = None) -> list[ExpertRecordEntry]:
    """Re-hash every expert record (or those of `records`) against the manifest; return the ones that fail."""
    corrupt = []
    chosen = pack.manifest.expert_records() if records is None else records
    for entry in tqdm(chosen, unit="record", desc="check records", disable=not progress):
        view = memoryview(pack.file_map(entry.file))[entry.offset:entry.offset + entry.length]
        if len(view) != entry.length or record_hash(view) != entry.xxh64:
            corrupt.append(entry)
    return corrupt
