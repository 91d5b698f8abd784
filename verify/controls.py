"""Negative controls: deliberately broken copies of a pack that verify must FAIL.

Each control damages the expert records, then re-hashes them and rewrites the manifest, so the
copy is self-consistent (it opens, every record passes its xxh64 check) and only the numerics can
catch the damage. A control that passes verify means the check is blind to that kind of damage.

    swap-nibbles   swap the two E2M1 nibbles of every byte of every record (the classic
                   element-order bug: element 2i read from the high nibble)
    zero-experts   zero the nibbles of every even-numbered expert (a missed copy, a stale buffer)
    shift-scales   multiply the three float32 global scales of every record by 2

The copy symlinks everything it does not change (dense tensors, PLE rows, tokenizer) and rewrites
the expert files in full, so it needs about the experts' size of free space next to the pack.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np

from flashpack.errors import FlashpackError
from flashpack.layout.manifest import MANIFEST_FILE, write_manifest
from flashpack.layout.pack import Pack
from flashpack.layout.records import TRAILER, RecordGeometry, record_hash

CONTROLS = ("swap-nibbles", "zero-experts", "shift-scales")
SCALE_SHIFT = 2.0


def make_control(pack: Pack, kind: str, workdir: Path) -> Path:
    """Write a damaged copy of `pack` under `workdir`; returns its directory."""
    if kind not in CONTROLS:
        raise FlashpackError(f"unknown control {kind!r}: choose one of {', '.join(CONTROLS)}")
    out = Path(workdir) / f"{pack.root.name}.{kind}"
    out.mkdir(parents=True)
    document = copy.deepcopy(pack.manifest.document)
    records = document["experts"]["records"]
    damaged_files = sorted({entry["file"] for entry in records})
    tops = {name.split("/")[0] for name in damaged_files}
    for item in pack.root.iterdir():
        if item.name != MANIFEST_FILE and item.name not in tops:
            (out / item.name).symlink_to(item.resolve())
    for name in damaged_files:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pack.root / name, out / name)
    geometry = pack.manifest.geometry
    handles = {name: open(out / name, "r+b") for name in damaged_files}
    try:
        for entry in records:
            record = np.frombuffer(
                bytearray(pack.record_bytes(entry["layer"], entry["expert"])), dtype=np.uint8
            )
            _damage(kind, record, geometry, entry["expert"])
            handle = handles[entry["file"]]
            handle.seek(entry["offset"])
            handle.write(record.tobytes())
            entry["xxh64"] = record_hash(record.tobytes())
    finally:
        for handle in handles.values():
            handle.close()
    write_manifest(out, document, rewritten=damaged_files)  # their whole-file hashes changed too
    return out


def _damage(kind: str, record: np.ndarray, geometry: RecordGeometry, expert: int) -> None:
    """Damage one record (uint8 [length], writable) in place."""
    parts = {name: (offset, length) for name, offset, length in geometry.parts()}
    nibbles = [parts[f"{p}_nibbles"] for p in ("gate", "up", "down")]
    if kind == "swap-nibbles":
        for offset, length in nibbles:
            block = record[offset:offset + length]
            block[:] = (block >> 4) | (block << 4)
    elif kind == "zero-experts":
        if expert % 2 == 0:
            for offset, length in nibbles:
                record[offset:offset + length] = 0
    elif kind == "shift-scales":
        offset, length = parts["trailer"]
        *scales, magic = TRAILER.unpack(record[offset:offset + length].tobytes())
        shifted = TRAILER.pack(*(s * SCALE_SHIFT for s in scales), magic)
        record[offset:offset + length] = np.frombuffer(shifted, dtype=np.uint8)

