"""`flashpack convert`: a checked source snapshot in, a complete pack out, or nothing at all.

Before a byte is written, the source is checked (source.py: config, index, shard headers, files
kept inside the snapshot) and so is OUT (out_path.py: apart from the source; only an empty
directory or a pack may be replaced). Everything is written into a hidden sibling directory that
has no manifest until the very end, then renamed into place (pack_swap.py); an interrupted or
failed convert never leaves something that looks like a pack, and a full disk or a file-size limit
is one line naming OUT. Memory stays bounded: tensors stream one at a time from the shards.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import xxhash
from tqdm import tqdm

from flashpack import __version__
from flashpack.convert.dense_writer import write_dense, write_vision
from flashpack.convert.expert_writer import write_experts
from flashpack.convert.out_path import check_apart_from_source, check_replaceable, make_parents, remove_created
from flashpack.convert.pack_swap import discard, move_into_place, settle_leftovers, staging_path
from flashpack.convert.ple_writer import write_ple
from flashpack.convert.source import SourceCheckpoint, resolve_snapshot
from flashpack.convert.tokenizer_files import check_tokenizer, copy_tokenizer
from flashpack.errors import FlashpackError
from flashpack.layout.checksums import DIGESTS_SUFFIX, file_entries
from flashpack.layout.manifest import FORMAT_NAME, FORMAT_VERSION, write_manifest
from flashpack.layout.records import RecordGeometry

_HASH_CHUNK = 16 << 20
# Errors of a write that the user can fix (room, quota, limits, permissions), each as one line.
_DISK_ERRORS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "a file outgrew the file-size limit (`ulimit -f`) or the file system's largest file",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
}


def convert(
    source: str,
    out: Path,
    *,
    revision: str | None = None,
    force: bool = False,
    dense_fp8: bool = False,
    progress: bool = True,
) -> Path:
    """Convert `source` (snapshot dir or hub repo id) into a pack at `out`; returns `out`.

    With `force`, an existing pack (or empty directory) at `out` is replaced; anything else there is
    refused, as is an `out` that is, contains or lies inside the source.
    """
    out = Path(out).expanduser().resolve()
    root, repo_id = resolve_snapshot(source, revision)
    check_apart_from_source(out, root)
    settle_leftovers(out)
    check_replaceable(out, force)
    checkpoint = SourceCheckpoint.open(root, repo_id)
    created: list[Path] = []
    staging = staging_path(out)
    try:
        created = make_parents(out)
        _check_free_space(checkpoint, out.parent)
        staging.mkdir()
        document = _write_pack(checkpoint, staging, revision, dense_fp8, progress)
        write_manifest(staging, document)
        check_replaceable(out, force)  # again: OUT may have changed during an hour of converting
        move_into_place(staging, out)
    except OSError as error:
        _clean_up(staging, created)
        if error.errno in _DISK_ERRORS:
            raise FlashpackError(f"{_DISK_ERRORS[error.errno]} while writing {out}{_which_file(error, staging)}") from None
        raise
    except BaseException:
        _clean_up(staging, created)
        raise
    return out


def _which_file(error: OSError, staging: Path) -> str:
    """` (experts/layer-003.bin)`: the pack file a write failed on, named as it is in the pack."""
    if not error.filename:
        return ""
    path = Path(error.filename)
    return f" ({path.relative_to(staging)})" if path.is_relative_to(staging) else f" ({path})"


def _clean_up(staging: Path, created: list[Path]) -> None:
    if staging.exists():
        discard(staging)
    remove_created(created)


def _write_pack(checkpoint: SourceCheckpoint, pack: Path, revision: str | None, dense_fp8: bool, progress: bool) -> dict:
    cfg = checkpoint.config
    tokenizer_files = copy_tokenizer(checkpoint.root, pack)
    check_tokenizer(pack, checkpoint.root)  # first: a broken tokenizer fails in seconds, not after the experts
    source_files = _fingerprint(checkpoint, progress)
    records = write_experts(checkpoint, pack, progress)
    ple_tables = write_ple(checkpoint, pack, progress)
    dense = write_dense(checkpoint, pack, dense_fp8, progress)
    vision = write_vision(checkpoint, pack)
    geometry = RecordGeometry(cfg.hidden_size, cfg.moe_intermediate_size)
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "created_by": f"flashpack {__version__}",
        "model": {"source_model_type": checkpoint.form, "text_config": cfg.raw},
        "source": {
            "path": str(checkpoint.root), "repo_id": checkpoint.repo_id, "revision": revision,
            "quantization": checkpoint.quantization, "files": source_files,
        },
        "files": _inventory(pack),
        "dense": dense,
        "vision": vision,
        "experts": {
            "hidden_size": geometry.hidden, "intermediate_size": geometry.intermediate,
            "record_bytes": geometry.length, "record_stride": geometry.stride,
            "parts": [{"name": n, "offset": o, "length": l} for n, o, l in geometry.parts()],
            "records": records,
        },
        "ple": ple_tables,
        "tokenizer": {"files": tokenizer_files},
        "hot_sets": {},
    }


def source_fingerprint(root: Path, files: list[str], progress: bool = False) -> list[dict]:
    """Size and xxHash64 of each checkpoint file: what `verify` checks a reference against."""
    entries = []
    total = sum((root / name).stat().st_size for name in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="fingerprint", disable=not progress) as bar:
        for name in files:
            digest = xxhash.xxh64()
            with open(root / name, "rb") as handle:
                while chunk := handle.read(_HASH_CHUNK):
                    digest.update(chunk)
                    bar.update(len(chunk))
            entries.append({"name": name, "bytes": (root / name).stat().st_size, "xxh64": digest.hexdigest()})
    return entries


def _fingerprint(checkpoint: SourceCheckpoint, progress: bool) -> list[dict]:
    names = ["config.json", *checkpoint.files]
    return source_fingerprint(checkpoint.root, names, progress)


_ROLES = {"experts": "experts", "ple": "ple", "tokenizer": "tokenizer"}


def _inventory(pack: Path) -> list[dict]:
    """Every file written so far with its size, role and xxh64; dense, vision and PLE files also
    get a digest file of their blocks (written here, listed too). A second sequential read of the
    pack, at xxh64's ~11 GB/s plus the disk."""
    entries = []
    for path in sorted(p for p in pack.rglob("*") if p.is_file() and not p.name.endswith(DIGESTS_SUFFIX)):
        relative = path.relative_to(pack).as_posix()
        top = relative.split("/")[0]
        role = _ROLES.get(top) or ("vision" if relative.startswith("vision") else "dense")
        entries += file_entries(pack, relative, role)
    return sorted(entries, key=lambda entry: entry["path"])


def _check_free_space(checkpoint: SourceCheckpoint, directory: Path) -> None:
    cfg = checkpoint.config
    geometry = RecordGeometry(cfg.hidden_size, cfg.moe_intermediate_size)
    expert_layers = cfg.num_hidden_layers + (cfg.mtp_num_hidden_layers if checkpoint.has_mtp else 0)
    needed = expert_layers * cfg.num_experts * geometry.stride
    needed += sum(cfg.ple_table_rows(i) * (cfg.ple_head_dim + 4) for i in range(len(cfg.ple_layer_ids)))
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise FlashpackError(
            f"no space left: the pack needs at least {needed / 2**30:.2f} GiB, {directory} has {free / 2**30:.2f} GiB free"
        )

