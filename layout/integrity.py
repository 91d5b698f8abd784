"""`flashpack inspect --check`: every byte of a pack against its manifest, every problem named.

Unlike `Pack.open`, which stops at the first problem, this reads the whole pack once and lists
them all: the manifest's own hash and its consistency (layout/consistency.py), each file's size
and whole-file xxh64, each block of the block-hashed files (naming the block and, in a tensor
file, the tensors it overlaps; in a PLE file, the layer and rows), and each expert record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from flashpack.errors import FlashpackError
from flashpack.layout.block_contents import block_contents
from flashpack.layout.checksums import block_failure, hash_file
from flashpack.layout.consistency import consistency_problems
from flashpack.layout.inspect import find_corrupt_records
from flashpack.layout.manifest import Manifest, manifest_hash_problem
from flashpack.layout.pack import Pack, missing_or_resized


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
    manifest = report.pack.manifest
    failed_before = len(report.problems)
    blocks = 0
    with tqdm(total=sum(e["bytes"] for e in entries), unit="B", unit_scale=True, desc="check files",
              disable=not progress) as bar:
        for entry in entries:
            digest = hash_file(root / entry["path"], entry.get("block_bytes"), progress=bar.update)
            failed_blocks = []
            if digest.blocks is not None:
                blocks += len(digest.blocks)
                describe = block_contents(manifest, entry["path"], entry["block_bytes"])
                failed_blocks = [block_failure(entry["path"], index, entry["block_bytes"], entry["bytes"], describe)
                                 for index, (actual, expected) in enumerate(zip(digest.blocks, entry["blocks"]))
                                 if actual != expected]
            report.problems += failed_blocks
            if digest.xxh64 != entry["xxh64"] and not failed_blocks:  # a failing block says it more precisely
                report.problems.append(f"pack damaged: {entry['path']} fails its whole-file xxh64 check")
    if len(report.problems) == failed_before:
        total = sum(e["bytes"] for e in entries)
        report.checked.append(f"files            all {len(entries)} ({total / 2**20:.1f} MiB) match their whole-file "
                              f"xxh64, and all {blocks} blocks of the dense, vision and PLE files theirs")


def _intact_size(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size
