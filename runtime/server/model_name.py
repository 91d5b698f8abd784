"""The model id clients see by default: the model's own name, from what the pack records of its source.

In order: the hub repo id it was converted from (`source.repo_id`); the text config's
`_name_or_path` / `name_or_path`; the source snapshot's folder, read as ORG/NAME where it is a hub
cache path (`.../models--ORG--NAME/snapshots/HASH`); last, the pack's folder without `.pack`.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath
from typing import Any

from flashpack.layout.manifest import Manifest

_HUB_CACHE_PREFIX = "models--"


def pack_model_name(pack: str | os.PathLike) -> str:
    """The default model id for the pack at `pack` (reads its manifest only)."""
    return model_name_from_manifest(Manifest.read(Path(pack)).document, pack)


def model_name_from_manifest(document: dict[str, Any], pack: str | os.PathLike) -> str:
    source = document.get("source") or {}
    if source.get("repo_id"):
        return str(source["repo_id"])
    text_config = (document.get("model") or {}).get("text_config") or {}
    for key in ("_name_or_path", "name_or_path"):
        if isinstance(text_config.get(key), str) and text_config[key].strip():
            return _name_from_path(text_config[key].strip())
    if source.get("path"):
        return _name_from_path(str(source["path"]))
    name = PurePath(os.path.normpath(os.fspath(pack))).name
    return name.removesuffix(".pack") or name


def _name_from_path(path: str) -> str:
    """A repo id as it is; a local path's folder name; a hub cache snapshot path as ORG/NAME."""
    parts = PurePath(os.path.normpath(path)).parts
    for part in reversed(parts):
        if part.startswith(_HUB_CACHE_PREFIX):
            return part[len(_HUB_CACHE_PREFIX):].replace("--", "/", 1)
    if not PurePath(path).is_absolute() and len(parts) == 2 and not path.startswith("."):
        return path  # ORG/NAME: a repo id, not a local folder
    return parts[-1] if parts else path
