"""Which files of a snapshot `convert` may read: those inside it, or its hub cache repo's own blobs.

Index entries and tokenizer files are names relative to the snapshot root, and they are input the
snapshot's author controls. An absolute name, a `..` component or a symlink resolving outside the
snapshot is refused: a crafted index would otherwise make convert read, and record in the manifest,
any file on the machine, and a `tokenizer_config.json -> /etc/passwd` link would be copied into the
pack. A Hugging Face cache snapshot (`<repo>/snapshots/<commit>/`) is made of symlinks into its
repo folder's `blobs/`: exactly that target is allowed as well.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from flashpack.errors import FlashpackError


def hub_repo_folder(root: Path) -> Path | None:
    """The cache's `models--owner--name` folder when `root` resolves to one of its snapshots, else None."""
    real = root.resolve()
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return None


def snapshot_file(root: Path, name: object, what: str) -> Path:
    """`root / name` once `name` is known to stay inside the snapshot; `what` names it in the error."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise FlashpackError(f"{what} {name!r} is not a file name")
    relative = PurePosixPath(name)
    if relative.is_absolute() or "\\" in name:
        raise FlashpackError(f"{what} {name} is an absolute path: files must lie inside the snapshot {root}")
    if ".." in relative.parts:
        raise FlashpackError(f"{what} {name} climbs out with '..': files must lie inside the snapshot {root}")
    path = root / relative
    real_root, target = root.resolve(), path.resolve()
    if target.is_relative_to(real_root):
        return path
    repo = hub_repo_folder(root)
    if repo is not None and target.parent == repo / "blobs":
        return path
    raise FlashpackError(
        f"{what} {name} is a link to {target}, outside the snapshot {real_root}: refusing to read it"
    )
