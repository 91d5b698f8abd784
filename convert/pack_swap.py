"""Putting a finished pack at OUT, and clearing what an interrupted convert left beside it.

The pack is built in `.NAME.partial-PID` beside OUT and gets its manifest.json last: until then
nothing there is a pack. With --force, OUT's old pack is renamed to `.NAME.old-PID`, the new one is
renamed onto OUT, and the old one loses its manifest before the rest of it goes, so it stops being a
pack right after it stopped being OUT. A convert killed between those two renames leaves no OUT and
the old pack whole at `.NAME.old-PID`: the next convert to OUT renames it back before anything else,
so a crash never leaves the user with neither pack. Leftovers named exactly `.NAME.partial-PID` or
`.NAME.old-PID` whose PID is no live process are removed by the next convert to the same OUT; a live
convert's are left alone. Two windows remain in which a hidden leftover is a whole pack (a staging
directory between its manifest and its rename; an old pack between the second rename and the
removal of its manifest), each two system calls long; the next convert clears what they leave.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from flashpack.convert.out_path import is_pack
from flashpack.layout.manifest import MANIFEST_FILE


def staging_path(out: Path) -> Path:
    return out.parent / f".{out.name}.partial-{os.getpid()}"


def _old_path(out: Path) -> Path:
    return out.parent / f".{out.name}.old-{os.getpid()}"


def move_into_place(staging: Path, out: Path) -> None:
    """Rename the finished pack onto OUT; what was at OUT (checked replaceable) goes only after that."""
    if not out.exists() and not out.is_symlink():
        staging.rename(out)
        return
    old = _old_path(out)
    out.rename(old)
    try:
        staging.rename(out)
    except BaseException:
        old.rename(out)
        raise
    discard(old)


def discard(path: Path) -> None:
    """Remove a staging directory or an old pack, its manifest first so that it is no pack from then on."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
        return
    (path / MANIFEST_FILE).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def settle_leftovers(out: Path) -> Path | None:
    """Before a convert to OUT: put back the old pack a killed convert had moved aside (when OUT is
    missing), then remove what dead converts to OUT left. Returns the leftover put back, if any."""
    dead = [(path, kind) for path, kind, pid in _leftovers(out) if not _is_live(pid)]
    restored = None
    if not out.exists() and not out.is_symlink():
        old_packs = [path for path, kind in dead if kind == "old" and is_pack(path)]
        if old_packs:
            restored = max(old_packs, key=lambda path: path.stat().st_mtime)
            restored.rename(out)
    for path, _ in dead:
        if path != restored:
            discard(path)
    return restored


def _leftovers(out: Path) -> list[tuple[Path, str, int]]:
    if not out.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(partial|old)-(\d+)")
    found = []
    for path in out.parent.iterdir():
        match = pattern.fullmatch(path.name)
        if match:
            found.append((path, match[1], int(match[2])))
    return found


def _is_live(pid: int) -> bool:
    """Whether `pid` is a running process other than this one (which can own no leftover: a
    leftover with our PID was left by a dead process that had it before, as in a container)."""
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # running, as another user
        return True
    except (OverflowError, OSError):
        return False
    return True
