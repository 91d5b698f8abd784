"""Hot-set profiles: which experts of each layer a workload used most, kept in the manifest.

A profile is built from a routing trace (`hot_set_from_trace`), stored under the manifest's
`hot_sets[NAME]` (`save_hot_set`, validated and written atomically), and used at start to
pre-warm the store (`apply_hot_set`). `reorder_pack` rewrites each layer's record file so the
profile's hot experts are contiguous, hottest first; in the manifest only record offsets and the
rewritten files' whole-file hashes change. Both write through `write_manifest`, which re-stamps
the manifest's own hash.

Document (FORMAT.md section 2, `hot_sets`):
    {"version": 1, "created_by": "flashpack 0.1.0", "unit": "fetches",
     "workload": {"file", "xxh64", "prompts", "prompt_tokens", "generated_tokens", "max_tokens"},
     "layers": [{"layer": 0, "requests": 123, "experts": [7, 3, ...], "counts": [40, 31, ...]}, ...],
     "reordered": false}
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flashpack import __version__
from flashpack.errors import FlashpackError, PackDamageError
from flashpack.layout.manifest import Manifest, write_manifest
from flashpack.layout.records import record_hash
from flashpack.runtime.store.trace import Trace

HOT_SET_VERSION = 1


def hot_set_from_trace(trace: Trace, workload: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank each layer's experts by how many fetches asked for them (ties: lower id first)."""
    counts: dict[int, dict[int, int]] = {layer: {} for layer in trace.layers}
    requests: dict[int, int] = {layer: 0 for layer in trace.layers}
    for layer, experts in trace.fetches():
        layer_counts = counts.setdefault(layer, {})
        requests[layer] = requests.get(layer, 0) + 1
        for expert in experts:
            layer_counts[expert] = layer_counts.get(expert, 0) + 1
    layers = []
    for layer in sorted(counts):
        ranked = sorted(counts[layer].items(), key=lambda item: (-item[1], item[0]))
        layers.append({"layer": layer, "requests": requests.get(layer, 0),
                       "experts": [e for e, _ in ranked], "counts": [c for _, c in ranked]})
    return {"version": HOT_SET_VERSION, "created_by": f"flashpack {__version__}", "unit": "fetches",
            "workload": workload or {}, "layers": layers, "reordered": False}


def ranked_experts(profile: dict[str, Any]) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """(experts hottest first, their counts) per layer."""
    if profile.get("version") != HOT_SET_VERSION:
        raise FlashpackError(f"hot set version {profile.get('version')} is not supported (reads {HOT_SET_VERSION})")
    return ({entry["layer"]: list(entry["experts"]) for entry in profile["layers"]},
            {entry["layer"]: list(entry["counts"]) for entry in profile["layers"]})


def save_hot_set(pack_root: Path | str, name: str, profile: dict[str, Any]) -> None:
    pack_root = Path(pack_root)
    document = Manifest.load(pack_root).document
    document["hot_sets"] = {**document.get("hot_sets", {}), name: profile}
    write_manifest(pack_root, document)


def apply_hot_set(store, profile: dict[str, Any]) -> dict[str, int]:
    """Pre-warm `store` (device pool, then host cache) from a profile; returns records per tier."""
    ranked, counts = ranked_experts(profile)
    return store.prewarm(ranked, counts)


def reorder_pack(pack_root: Path | str, name: str, verify: bool = True) -> dict[int, int]:
    """Rewrite every expert file so hot set `name`'s experts come first, hottest first, the rest
    in expert order. Each layer file is written to a temporary sibling, synced, swapped in with
    rename(2), then the manifest is written atomically before the next layer (new offsets and the
    file's new whole-file xxh64; record hashes and file sizes stay); records are hash-checked
    while copied. Returns records moved per layer.

    Run it on a pack no process is reading: a running store keeps the old files open."""
    pack_root = Path(pack_root)
    document = Manifest.load(pack_root).document
    profile = document["hot_sets"].get(name)
    if profile is None:
        raise FlashpackError(f"pack has no hot set {name!r}")
    ranked, _ = ranked_experts(profile)
    stride = document["experts"]["record_stride"]
    records = document["experts"]["records"]
    moved: dict[int, int] = {}
    by_file: dict[str, list[dict]] = {}
    for record in records:
        by_file.setdefault(record["file"], []).append(record)
    for file, entries in sorted(by_file.items()):
        layers = {e["layer"] for e in entries}
        hot = [e for layer in sorted(layers) for e in ranked.get(layer, [])]
        rank = {expert: index for index, expert in enumerate(hot)}
        order = sorted(entries, key=lambda e: (rank.get(e["expert"], len(rank)), e["layer"], e["expert"]))
        moved_here = _rewrite_file(pack_root, file, order, stride, verify)
        document["experts"]["records"] = records  # entries were updated in place
        document["hot_sets"][name]["reordered"] = True
        write_manifest(pack_root, document, rewritten=[file])  # the file's xxh64 changed with its order
        for layer in layers:
            moved[layer] = moved.get(layer, 0) + moved_here
    return moved


def _rewrite_file(pack_root: Path, file: str, order: list[dict], stride: int, verify: bool) -> int:
    path = pack_root / file
    temporary = path.with_name(f".{path.name}.reorder-{os.getpid()}")
    moved = 0
    try:
        with open(path, "rb") as source, open(temporary, "wb") as target:
            new_offsets = []
            for entry in order:
                source.seek(entry["offset"])
                data = source.read(entry["length"])
                if verify and record_hash(data) != entry["xxh64"]:
                    raise PackDamageError(
                        f"corrupt expert record: layer {entry['layer']} expert {entry['expert']} fails its xxh64 check "
                        "(not reordered)"
                    )
                new_offsets.append(target.tell())
                target.write(data)
                target.write(bytes(stride - len(data)))
            size = path.stat().st_size
            if target.tell() != size:  # keep the size the manifest's files list states
                target.truncate(size) if target.tell() > size else target.write(bytes(size - target.tell()))
            target.flush()
            os.fsync(target.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    for entry, offset in zip(order, new_offsets):
        moved += entry["offset"] != offset
        entry["offset"] = offset
    return moved
