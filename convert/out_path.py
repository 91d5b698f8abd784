"""Where `convert` may write OUT: never over its own source, never over anything it did not write.

- OUT may not be, contain or lie inside the source snapshot, compared as resolved paths (so a
  symlink counts as where it leads), nor the hub cache repo folder a snapshot sits in (the
  snapshot's files are links into that folder's blobs).
- OUT's parent must be a directory, or folders that can be created.
- An existing OUT needs --force, and --force replaces only an empty directory or a flashpack pack:
  a manifest.json the pack schema accepts, and nothing in the directory that its manifest does not
  list (flashpack's own temporaries aside). A file, or a directory holding anything else, is
  refused with or without --force: nothing the user owns is ever deleted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from flashpack.convert.snapshot_paths import hub_repo_folder
from flashpack.errors import FlashpackError
from flashpack.layout.manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE, validate_manifest

# Files flashpack itself leaves in a pack for a moment: write_manifest's and reorder_pack's temporaries.
_PACK_TEMPORARIES = re.compile(r"^(manifest\.json\.tmp|\..+\.reorder-\d+)$")
_REFUSAL_ADVICE = "refusing to replace it; remove it yourself or choose another OUT"


def check_apart_from_source(out: Path, source_root: Path) -> None:
    """OUT (resolved) is neither the source, nor inside it, nor around it."""
    protected = [source_root.resolve()]
    repo = hub_repo_folder(source_root)
    if repo is not None:
        protected.append(repo)
    for folder in protected:
        if out == folder:
            relation = "is"
        elif out.is_relative_to(folder):
            relation = "lies inside"
        elif folder.is_relative_to(out):
            relation = "contains"
        else:
            continue
        raise FlashpackError(f"OUT {out} {relation} the source {folder}: choose an OUT outside the source")


def make_parents(out: Path) -> list[Path]:
    """Create OUT's missing parent folders; returns those created, outermost first."""
    missing = []
    for ancestor in out.parents:
        if ancestor.is_dir():
            break
        if ancestor.exists() or ancestor.is_symlink():
            raise FlashpackError(f"cannot write {out}: {ancestor} is a file, not a directory")
        missing.append(ancestor)
    missing.reverse()
    for folder in missing:
        folder.mkdir()
    return missing


def remove_created(folders: list[Path]) -> None:
    """Remove folders `make_parents` created, innermost first, where they are still empty."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


def check_replaceable(out: Path, force: bool) -> None:
    """Nothing at OUT, or something --force may replace and --force given."""
    if not out.exists() and not out.is_symlink():
        return
    problem = why_not_replaceable(out)
    if problem is not None:
        raise FlashpackError(f"{out} {problem}: {_REFUSAL_ADVICE}")
    if not force:
        raise FlashpackError(f"{out} already exists (use --force to replace it)")


def why_not_replaceable(out: Path) -> str | None:
    """None for an empty directory or a flashpack pack; otherwise what OUT is instead."""
    if out.is_symlink() or not out.is_dir():
        return "is a file, not a pack" if out.is_file() else "is not a directory"
    if not any(out.iterdir()):
        return None
    try:
        document = pack_manifest(out)
    except FlashpackError as error:
        return f"is a directory but not a flashpack pack ({error})"
    listed = {entry["path"] for entry in document["files"]} | {MANIFEST_FILE}
    for path in sorted(out.rglob("*")):
        relative = path.relative_to(out).as_posix()
        if relative in listed or _PACK_TEMPORARIES.match(path.name) or (path.is_dir() and not path.is_symlink()):
            continue
        return f"is a flashpack pack that also holds {relative}, which its manifest does not list"
    return None


def pack_manifest(folder: Path) -> dict:
    """The manifest document of the pack in `folder`; FlashpackError saying why it is not one."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise FlashpackError(f"no {MANIFEST_FILE}")
    try:
        document = json.loads(path.read_bytes())
    except ValueError:
        raise FlashpackError(f"{MANIFEST_FILE} is not JSON") from None
    if not isinstance(document, dict):
        raise FlashpackError(f"{MANIFEST_FILE} is not a JSON object")
    version = document.get("format_version")
    if document.get("format") == FORMAT_NAME and type(version) is int and 0 < version < FORMAT_VERSION:
        # An older format's pack is still one flashpack wrote, and --force is how it gets re-converted.
        files = document.get("files")
        if isinstance(files, list) and all(isinstance(e, dict) and isinstance(e.get("path"), str) for e in files):
            return document
        raise FlashpackError(f"{MANIFEST_FILE} of format version {version} has no list of files")
    validate_manifest(document)
    return document


def is_pack(folder: Path) -> bool:
    try:
        pack_manifest(folder)
    except FlashpackError:
        return False
    return True
