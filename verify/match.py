"""Is this snapshot the one the pack was converted from? Checked before any number is computed.

The manifest records the source's text config and the name, size and xxHash64 of config.json and
every safetensors shard (`source.files`, written by convert's `source_fingerprint`). A reference
that differs in any of them would make verify compare two different models, so it is refused with
one line naming the first difference.
"""

from __future__ import annotations

import json
from pathlib import Path

from flashpack.convert.pipeline import source_fingerprint
from flashpack.convert.source import SourceCheckpoint, resolve_snapshot
from flashpack.errors import FlashpackError
from flashpack.layout.manifest import Manifest
from flashpack.layout.model_config import TextConfig


def open_reference(manifest: Manifest, reference: str | Path, progress: bool = False) -> SourceCheckpoint:
    """The reference snapshot, opened and checked against the pack's recorded source."""
    revision = manifest.document["source"].get("revision")
    root, repo_id = resolve_snapshot(str(reference), revision)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FlashpackError(f"reference {root} has no config.json: not a Hugging Face snapshot")
    try:
        raw = json.loads(config_path.read_text())
    except ValueError as error:
        raise FlashpackError(f"reference {config_path} is not valid JSON: {error}") from None
    _check_config(manifest, TextConfig.from_checkpoint_config(raw).raw, root)
    snapshot = SourceCheckpoint.open(root, repo_id)
    _check_files(manifest, snapshot, root, progress)
    return snapshot


def _check_config(manifest: Manifest, snapshot_config: dict, root: Path) -> None:
    pack_config = manifest.document["model"]["text_config"]
    if snapshot_config == pack_config:
        return
    keys = set(pack_config) | set(snapshot_config)
    differing = sorted(k for k in keys if pack_config.get(k) != snapshot_config.get(k))
    first = differing[0]
    raise FlashpackError(
        f"reference {root} is another model than the pack: its text config differs in {len(differing)} field(s), "
        f"e.g. {first} = {snapshot_config.get(first)!r} (the pack has {pack_config.get(first)!r})"
    )


def _check_files(manifest: Manifest, snapshot: SourceCheckpoint, root: Path, progress: bool) -> None:
    recorded = {entry["name"]: entry for entry in manifest.document["source"]["files"]}
    present = {"config.json", *snapshot.files}
    if present != set(recorded):
        extra, missing = sorted(present - set(recorded)), sorted(set(recorded) - present)
        what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the pack's source did not"
        raise FlashpackError(f"reference {root} is not the snapshot the pack was converted from: it {what}")
    for entry in source_fingerprint(root, sorted(recorded), progress):
        expected = recorded[entry["name"]]
        if entry["bytes"] != expected["bytes"] or entry["xxh64"] != expected["xxh64"]:
            raise FlashpackError(
                f"reference {root} is not the snapshot the pack was converted from: {entry['name']} is "
                f"{entry['bytes']} bytes, xxh64 {entry['xxh64']} (the pack's source: {expected['bytes']} bytes, "
                f"xxh64 {expected['xxh64']})"
            )
