"""`flashpack inspect --check`: every byte of a pack against its manifest, every problem named.

Unlike `Pack.open`, which stops at the first problem, this reads the whole pack once and lists
them all: the manifest's own hash and its consistency (layout/consistency.py), each file's size
and whole-file xxh64, each block of the block-hashed files against their digest files (naming the
block and, in a tensor file, the tensors it overlaps; in a PLE file, the layer and rows), and each
expert record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from flashpack.errors import FlashpackError
from flashpack.layout.block_contents import block_contents
from flashpack.layout.checksums import DIGEST, DIGESTS_ROLE, block_failure, hash_file, xxh64_hex
from flashpack.layout.consistency import consistency_problems
from flashpack.layout.inspect import find_corrupt_records
from flashpack.layout.manifest import Manifest, manifest_hash_problem
from flashpack.layout.pack import Pack, missing_or_resized

_SHOWN_BLOCKS = 10  # a zeroed region fails thousands of blocks: name the first, count the rest


@dataclass
class CheckReport:
    pack: Pack  # opened without the open-time checks, so that a damaged pack can be summarised
    problems: list[str] = field(default_factory=list)  # one line each
    checked: list[str] = field(default_factory=list)  # one line per kind of check that passed

    @property
    def passed(self) -> bool:
        return not self.problems


def check_pack(root: Path | str, progress: bool = True) -> CheckReport:
    """Check everything; raises only when the manifest cannot be read at all (then nothing can)."""
    root = Path(root)
    if not root.is_dir():
        raise FlashpackError(f"pack {root} does not exist")
    manifest = Manifest.read(root)
    report = CheckReport(Pack(root, manifest))
    _check_manifest(report, root)
    report.problems += missing_or_resized(root, manifest)
    present = [e for e in manifest.files() if _intact_size(root / e["path"], e["bytes"])]
    _check_files(report, root, present, progress)
    readable = {entry["path"] for entry in present}
    records = [r for r in manifest.expert_records() if r.file in readable]
    corrupt = find_corrupt_records(report.pack, progress, records)
    report.problems += [f"corrupt expert record: layer {r.layer} expert {r.expert} ({r.file} @ {r.offset}) "
                        "fails its xxh64 check" for r in corrupt]
    if not corrupt:
        report.checked.append(f"expert records   all {len(records)} match their xxh64")
    return report


def _check_manifest(report: CheckReport, root: Path) -> None:
    document = report.pack.manifest.document
    problems = [p for p in [manifest_hash_problem(document)] if p] + consistency_problems(report.pack.manifest, root)
    report.problems += problems
    if not problems:
        report.checked.append("manifest         its xxh64 matches; its numbers agree with each other, the config "
                              "and the files")


def _check_files(report: CheckReport, root: Path, entries: list[dict], progress: bool) -> None:
    """Digest files first (their blocks' digests are what the other files are checked against),
    then every other file: whole-file hash and, where it has a digest file, every block."""
    manifest = report.pack.manifest
    failed_before = len(report.problems)
    digests = {}
    for entry in (e for e in entries if e["role"] == DIGESTS_ROLE):
        data = (root / entry["path"]).read_bytes()
        if xxh64_hex(data) == entry["xxh64"]:
            digests[entry["path"]] = np.frombuffer(data, dtype=DIGEST)
        else:
            report.problems.append(f"pack damaged: {entry['path']} fails its whole-file xxh64 check")
    blocks = 0
    data_files = [e for e in entries if e["role"] != DIGESTS_ROLE]
    with tqdm(total=sum(e["bytes"] for e in data_files), unit="B", unit_scale=True, desc="check files",
              disable=not progress) as bar:
        for entry in data_files:
            expected = digests.get(entry.get("block_digests"))
            digest = hash_file(root / entry["path"], None if expected is None else entry["block_bytes"], bar.update)
            failed = []
            if expected is not None and len(expected) == len(digest.blocks):
                blocks += len(expected)
                failed = _failed_blocks(manifest, entry, np.flatnonzero(digest.blocks != expected))
            if digest.xxh64 != entry["xxh64"] and not failed:  # a failing block says it more precisely
                failed = [f"pack damaged: {entry['path']} fails its whole-file xxh64 check"]
            report.problems += failed
    if len(report.problems) == failed_before:
        total = sum(e["bytes"] for e in entries)
        report.checked.append(f"files            all {len(entries)} ({total / 2**20:.1f} MiB) match their whole-file "
                              f"xxh64, and all {blocks} blocks of the dense, vision and PLE files theirs")


def _failed_blocks(manifest: Manifest, entry: dict, failed: np.ndarray) -> list[str]:
    describe = block_contents(manifest, entry["path"], entry["block_bytes"])
    lines = [block_failure(entry["path"], int(block), entry["block_bytes"], entry["bytes"], describe)
             for block in failed[:_SHOWN_BLOCKS]]
    if len(failed) > _SHOWN_BLOCKS:
        lines.append(f"pack damaged: {entry['path']}: {len(failed) - _SHOWN_BLOCKS} more blocks fail their xxh64 check")
    return lines


def _intact_size(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size
