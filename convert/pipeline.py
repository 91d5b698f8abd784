"""`flashpack convert`: a checked source snapshot in, a complete pack out, or nothing at all.

Everything is written into a hidden sibling directory that has no manifest until the very end,
then renamed into place; an interrupted or failed convert never leaves something that looks like
a pack. Memory stays bounded: tensors stream one at a time from memory-mapped shards.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import xxhash
from tqdm import tqdm

from flashpack import __version__
from flashpack.convert.dense_writer import write_dense, write_vision
from flashpack.convert.expert_writer import write_experts
from flashpack.convert.ple_writer import write_ple
from flashpack.convert.source import SourceCheckpoint, resolve_snapshot
from flashpack.errors import FlashpackError
from flashpack.layout.checksums import DIGESTS_SUFFIX, file_entries
from flashpack.layout.manifest import FORMAT_NAME, FORMAT_VERSION, write_manifest
from flashpack.layout.records import RecordGeometry

TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json",
)
_HASH_CHUNK = 16 << 20


def convert(
    source: str,
    out: Path,
    *,
    revision: str | None = None,
    force: bool = False,
    dense_fp8: bool = False,
    progress: bool = True,
) -> Path:
    """Convert `source` (snapshot dir or hub repo id) into a pack at `out`; returns `out`."""
    out = Path(out).resolve()
    if out.exists() and not force:
        raise FlashpackError(f"{out} already exists (use --force to replace it)")
    root, repo_id = resolve_snapshot(source, revision)
    checkpoint = SourceCheckpoint.open(root, repo_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    _check_free_space(checkpoint, out.parent)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        document = _write_pack(checkpoint, staging, revision, dense_fp8, progress)
        write_manifest(staging, document)
        _replace(staging, out)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        if error.errno == errno.ENOSPC:
            raise FlashpackError(f"no space left on the device while writing {out}") from None
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _write_pack(checkpoint: SourceCheckpoint, pack: Path, revision: str | None, dense_fp8: bool, progress: bool) -> dict:
    cfg = checkpoint.config
    source_files = _fingerprint(checkpoint, progress)
    records = write_experts(checkpoint, pack, progress)
    ple_tables = write_ple(checkpoint, pack, progress)
    dense = write_dense(checkpoint, pack, dense_fp8, progress)
    vision = write_vision(checkpoint, pack)
    tokenizer_files = _copy_tokenizer(checkpoint.root, pack)
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


def _copy_tokenizer(root: Path, pack: Path) -> list[str]:
    copied = []
    (pack / TOKENIZER_DIR).mkdir()
    for name in TOKENIZER_FILES:
        if (root / name).is_file():
            shutil.copyfile(root / name, pack / TOKENIZER_DIR / name)
            copied.append(f"{TOKENIZER_DIR}/{name}")
    if not copied:
        raise FlashpackError(f"{root} has no tokenizer files (tokenizer.json, tokenizer_config.json)")
    return copied


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


def _replace(staging: Path, out: Path) -> None:
    """Move the finished pack into place; an old pack (with --force) goes only after that succeeds."""
    if not out.exists():
        staging.rename(out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)
