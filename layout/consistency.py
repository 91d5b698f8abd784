"""The manifest's numbers checked against each other, the model config and the files at open.

A changed digit in a tensor offset, a shape, a record offset or a PLE row count would otherwise
surface as a reshape traceback or, worse, as different output. Each rule here names what
disagrees in one line. What no rule can catch (any float is a valid `rms_norm_eps`, any top-k up
to `num_experts` a valid `num_experts_per_tok`) the manifest's own hash catches (checksums.py).
"""

from __future__ import annotations

import json
import math
import struct
from collections import defaultdict
from pathlib import Path
from typing import Any

from flashpack.layout.checkpoint_spec import iter_specs
from flashpack.errors import FlashpackError
from flashpack.layout.checksums import DIGEST, DIGESTS_ROLE
from flashpack.layout.dtypes import dtype_bytes
from flashpack.layout.manifest import MANIFEST_FILE, Manifest, TensorEntry
from flashpack.layout.model_config import TextConfig
from flashpack.layout.records import PAGE, RecordGeometry

ROW_SCALE_SUFFIX = ".row_scale"
TOKENIZER_DIRECTORY = "tokenizer"
_SHOWN_PER_RULE = 5  # one bad stride makes every record wrong: name a few, count the rest
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


class _Problems:
    def __init__(self) -> None:
        self.by_rule: dict[str, list[str]] = defaultdict(list)

    def add(self, rule: str, message: str) -> None:
        self.by_rule[rule].append(f"{MANIFEST_FILE} contradicts the pack: {message}")

    def lines(self) -> list[str]:
        out = []
        for messages in self.by_rule.values():
            out += messages[:_SHOWN_PER_RULE]
            if len(messages) > _SHOWN_PER_RULE:
                out.append(f"{MANIFEST_FILE} contradicts the pack: ... and {len(messages) - _SHOWN_PER_RULE} more of this kind")
        return out


def consistency_problems(manifest: Manifest, root: Path) -> list[str]:
    """Every disagreement found, one line each (empty when the manifest is consistent)."""
    problems = _Problems()
    try:
        cfg = TextConfig.from_text_dict(manifest.document["model"]["text_config"])
    except FlashpackError as error:
        problems.add("config", f"model.text_config: {error}")
        return problems.lines()
    sizes = _file_sizes(manifest, problems)
    _check_config(cfg, problems)
    dense = manifest.dense_tensors()
    _check_tensor_file(root, manifest.document["dense"]["file"], dense, sizes, "dense", problems)
    if manifest.document.get("vision"):
        _check_tensor_file(root, manifest.document["vision"]["file"], manifest.vision_tensors(), sizes, "vision", problems)
    _check_dense_plan(cfg, dense, manifest.document["dense"]["fp8_rows"], problems)
    _check_experts(cfg, manifest, sizes, any(name.startswith("mtp.") for name in dense), problems)
    _check_ple(cfg, manifest, sizes, problems)
    for path in manifest.document["tokenizer"]["files"]:
        _listed(path, "tokenizer", sizes, problems)
    _check_tokenizer_directory(root, sizes, problems)
    return problems.lines()


def _file_sizes(manifest: Manifest, problems: _Problems) -> dict[str, tuple[str, int]]:
    sizes: dict[str, tuple[str, int]] = {}
    for entry in manifest.files():
        if entry["path"] in sizes:
            problems.add("files", f"files lists {entry['path']} twice")
        sizes[entry["path"]] = (entry["role"], entry["bytes"])
    for entry in manifest.files():
        if "block_digests" in entry:
            expected = -(-entry["bytes"] // entry["block_bytes"]) * DIGEST.itemsize
            size = _listed(entry["block_digests"], DIGESTS_ROLE, sizes, problems)
            if size is not None and size != expected:
                problems.add("files", f"{entry['block_digests']} is {size} bytes, {entry['path']}'s "
                                      f"{entry['bytes']} bytes in blocks of {entry['block_bytes']} need {expected}")
    return sizes


def _listed(path: str, role: str, sizes: dict[str, tuple[str, int]], problems: _Problems) -> int | None:
    """The file's size if `files` lists it with `role`; otherwise a problem (its bytes would go unhashed)."""
    if path not in sizes:
        problems.add("files", f"{path} is used but not listed in files (so never hashed)")
        return None
    if sizes[path][0] != role:
        problems.add("files", f"{path} is listed with role {sizes[path][0]}, it holds {role} data")
    return sizes[path][1]


def _check_tokenizer_directory(root: Path, sizes, problems: _Problems) -> None:
    """The tokenizer loader reads whatever files its directory holds: each must be a hashed one."""
    directory = root / TOKENIZER_DIRECTORY
    for path in sorted(directory.rglob("*")) if directory.is_dir() else []:
        relative = path.relative_to(root).as_posix()
        if path.is_file() and relative not in sizes:
            problems.add("files", f"{relative} is in the pack but not in files (the tokenizer would read it unchecked)")


def _check_config(cfg: TextConfig, problems: _Problems) -> None:
    eos = cfg.raw.get("eos_token_id")
    for token in eos if isinstance(eos, list) else [eos] if eos is not None else []:
        if not isinstance(token, int) or not 0 <= token < cfg.vocab_size:
            problems.add("config", f"eos_token_id {token} is outside the vocabulary (vocab_size {cfg.vocab_size})")
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        problems.add("config", f"num_experts_per_tok {cfg.num_experts_per_tok} is not in [1, num_experts {cfg.num_experts}]")


def _check_tensor_file(root: Path, path: str, tensors: dict[str, TensorEntry], sizes, role: str, problems: _Problems) -> None:
    size = _listed(path, role, sizes, problems)
    if size is None:
        return
    header = _safetensors_header(root / path, size, problems)
    data_start = header[0] if header else 8
    for entry in tensors.values():
        expected = math.prod(entry.shape) * dtype_bytes(entry.dtype)
        if entry.length != expected:
            problems.add(role, f"{path} tensor {entry.name}: length {entry.length} is not "
                               f"{entry.dtype}{list(entry.shape)}'s {expected} bytes")
        if entry.offset < data_start or entry.offset + entry.length > size:
            problems.add(role, f"{path} tensor {entry.name}: bytes {entry.offset}-{entry.offset + entry.length} "
                               f"lie outside the file's data ({data_start}-{size})")
        if header is not None:
            stored = header[1].get(entry.name)
            written = None if stored is None else (stored.get("dtype"), stored.get("shape"),
                                                   [data_start + o for o in stored.get("data_offsets", [])])
            if written != (entry.dtype, list(entry.shape), [entry.offset, entry.offset + entry.length]):
                problems.add(role, f"{path} tensor {entry.name}: the manifest's {entry.dtype}{list(entry.shape)} at "
                                   f"{entry.offset}+{entry.length} is not what the file's header says ({written})")
    ordered = sorted(tensors.values(), key=lambda entry: entry.offset)
    for before, after in zip(ordered, ordered[1:]):
        if before.offset + before.length > after.offset:
            problems.add(role, f"{path} tensors {before.name} and {after.name} overlap")


def _safetensors_header(path: Path, size: int, problems: _Problems) -> tuple[int, dict[str, Any]] | None:
    """(absolute data start, header) of a safetensors file, or None (with a problem) when unreadable."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > min(size - 8, _MAX_HEADER_BYTES):
                raise ValueError(f"header length {length} does not fit the file")
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error) as error:
        problems.add("header", f"{path.name}: the safetensors header cannot be read ({error})")
        return None
    return 8 + length, header


def _check_dense_plan(cfg: TextConfig, dense: dict[str, TensorEntry], fp8_rows: bool, problems: _Problems) -> None:
    """Dense tensors are exactly the ones the config implies, in the shapes it implies."""
    with_mtp = any(name.startswith("mtp.") for name in dense)
    planned = {spec.name: spec.shape for spec in iter_specs(cfg, with_mtp=with_mtp) if spec.role == "dense"}
    for name, shape in planned.items():
        entry = dense.get(name)
        if entry is None:
            problems.add("plan", f"dense tensor {name} {list(shape)}, which the config implies, is missing")
            continue
        if entry.shape != shape:
            problems.add("plan", f"dense tensor {name} has shape {list(entry.shape)}, the config implies {list(shape)}")
        if entry.dtype == "F8_E4M3" and fp8_rows:
            scale = dense.get(entry.row_scale or "")
            if entry.row_scale != name + ROW_SCALE_SUFFIX or scale is None or scale.dtype != "F32" \
                    or scale.shape != shape[:1]:
                problems.add("plan", f"dense tensor {name} is FP8 without a float32 [{shape[0]}] {name}{ROW_SCALE_SUFFIX}")
        elif entry.dtype != "BF16":
            problems.add("plan", f"dense tensor {name} is {entry.dtype}, not BF16"
                                 f"{' or FP8 rows' if fp8_rows else ''}")
    scales = {entry.row_scale for entry in dense.values() if entry.row_scale}
    for name in dense.keys() - planned.keys() - scales:
        problems.add("plan", f"dense tensor {name} is not one the config implies")


def _check_experts(cfg: TextConfig, manifest: Manifest, sizes, with_mtp: bool, problems: _Problems) -> None:
    experts = manifest.document["experts"]
    geometry = RecordGeometry(cfg.hidden_size, cfg.moe_intermediate_size)
    record_bytes, stride = geometry.length, geometry.stride  # computed once: 25k records at real dimensions
    if (experts["hidden_size"], experts["intermediate_size"]) != (cfg.hidden_size, cfg.moe_intermediate_size):
        problems.add("geometry", f"experts are {experts['hidden_size']} x {experts['intermediate_size']}, the config "
                                 f"says hidden_size {cfg.hidden_size}, moe_intermediate_size {cfg.moe_intermediate_size}")
    if (experts["record_bytes"], experts["record_stride"]) != (record_bytes, stride):
        problems.add("geometry", f"record_bytes {experts['record_bytes']} / record_stride {experts['record_stride']} "
                                 f"are not the geometry's {record_bytes} / {stride}")
    if [(p["name"], p["offset"], p["length"]) for p in experts["parts"]] != geometry.parts():
        problems.add("geometry", "experts.parts is not the record layout the geometry implies")
    layers = cfg.num_hidden_layers + (cfg.mtp_num_hidden_layers if with_mtp else 0)
    expected = {(layer, expert) for layer in range(layers) for expert in range(cfg.num_experts)}
    records = manifest.expert_records()
    file_sizes = {file: _listed(file, "experts", sizes, problems) for file in sorted({r.file for r in records})}
    seen: set[tuple[int, int]] = set()
    by_file: dict[str, list[int]] = defaultdict(list)
    for record in records:
        key = (record.layer, record.expert)
        if key in seen:
            problems.add("records", f"layer {record.layer} expert {record.expert} has two records")
        seen.add(key)
        size = file_sizes[record.file]
        by_file[record.file].append(record.offset)
        if record.length != record_bytes:
            problems.add("records", f"layer {record.layer} expert {record.expert}: length {record.length}, "
                                    f"records are {record_bytes} bytes")
        if record.offset % PAGE or (size is not None and record.offset + stride > size):
            problems.add("records", f"layer {record.layer} expert {record.expert}: offset {record.offset} is not "
                                    f"a page boundary with a whole {stride}-byte record inside {record.file}")
    for layer, expert in sorted(expected - seen)[:_SHOWN_PER_RULE + 1]:
        problems.add("records", f"layer {layer} expert {expert}, which the config implies, has no record")
    for layer, expert in sorted(seen - expected)[:_SHOWN_PER_RULE + 1]:
        problems.add("records", f"layer {layer} expert {expert} is not one the config implies")
    for file, offsets in by_file.items():
        offsets.sort()
        for before, after in zip(offsets, offsets[1:]):
            if after - before < stride:
                problems.add("records", f"{file}: records at {before} and {after} overlap")


def _check_ple(cfg: TextConfig, manifest: Manifest, sizes, problems: _Problems) -> None:
    tables = manifest.ple_tables()
    if len(tables) != len(cfg.ple_layer_ids):
        problems.add("ple", f"{len(tables)} PLE tables, the config's ple_layer_ids imply {len(cfg.ple_layer_ids)}")
    for index, table in enumerate(tables[:len(cfg.ple_layer_ids)]):
        vocab = cfg.ple_head_vocab_sizes(index)
        expected = {
            "layer": cfg.ple_layer_ids[index] - 1, "ple_index": index, "dim": cfg.ple_head_dim,
            "row_stride": cfg.ple_head_dim + 4, "rows": cfg.ple_table_rows(index),
            "head_vocab_sizes": tuple(vocab), "head_offsets": tuple(cfg.ple_head_offsets(index)),
            "multipliers": tuple(cfg.ple_multipliers(index)),
        }
        for key, value in expected.items():
            if getattr(table, key) != value:
                problems.add("ple", f"PLE table {index} {key} is {_short(getattr(table, key))}, the config implies {_short(value)}")
        size = _listed(table.file, "ple", sizes, problems)
        if size is not None and table.rows * table.row_stride != size:
            problems.add("ple", f"PLE table {index}: {table.rows} rows of {table.row_stride} bytes is not "
                                f"{table.file}'s {size} bytes")


def _short(value: Any) -> str:
    text = str(list(value) if isinstance(value, tuple) else value)
    return text if len(text) <= 80 else text[:77] + "..."

