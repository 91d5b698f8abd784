"""A Hugging Face checkpoint to convert: find it, check it, and read its tensors by canonical name.

The snapshot is a local directory or a hub repo id resolved by huggingface_hub (which honours
HF_HUB_OFFLINE, the local cache and `revision`). Everything that can be checked before writing a
byte is checked here, so a bad source fails in seconds with one line, not an hour into a convert.

Tensors are read with positional reads at the offsets the safetensors headers give, not through a
memory map: a map keeps every page it touched resident for as long as the file stays open, so
streaming a 133 GB checkpoint through mmap shows as tens of GB of RSS; a read holds one tensor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashpack.layout.checkpoint_spec import (
    Form,
    TensorSpec,
    checkpoint_key,
    is_vision_key,
    iter_specs,
)
from flashpack.convert.safetensors_header import read_safetensors_header
from flashpack.convert.snapshot_paths import snapshot_file
from flashpack.errors import FlashpackError
from flashpack.layout.dtypes import TORCH_DTYPES
from flashpack.layout.model_config import TextConfig

SNAPSHOT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "merges.txt"]
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def resolve_snapshot(source: str, revision: str | None = None) -> tuple[Path, str | None]:
    """(local snapshot dir, hub repo id or None). A path that exists wins over a repo id."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path, None
    if path.exists():
        raise FlashpackError(f"{source} is a file; give a snapshot directory or a hub repo id")
    if source.count("/") != 1 or source.startswith((".", "/")):
        raise FlashpackError(f"source {source!r} is neither a directory nor a hub repo id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(source, revision=revision, allow_patterns=SNAPSHOT_PATTERNS)), source
    except LocalEntryNotFoundError:
        raise FlashpackError(
            f"{source} (revision {revision or 'main'}) is not in the local Hugging Face cache and the hub "
            "cannot be reached (HF_HUB_OFFLINE is set or there is no network)"
        ) from None
    except (RepositoryNotFoundError, HfHubHTTPError) as error:
        raise FlashpackError(f"cannot fetch {source}: {str(error).splitlines()[0]}") from None


@dataclass(frozen=True)
class NVFP4Parts:
    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: float


@dataclass
class SourceCheckpoint:
    """A checked snapshot: its config, form, quantisation and a key -> shard map."""

    root: Path
    repo_id: str | None
    config: TextConfig
    raw_config: dict
    form: Form
    quantization: str  # "bf16" (any float dtype) or "nvfp4"
    entries: dict[str, "StoredTensor"]

    @classmethod
    def open(cls, root: Path, repo_id: str | None = None) -> "SourceCheckpoint":
        config_path = snapshot_file(root, "config.json", "config file")
        if not config_path.is_file():
            raise FlashpackError(f"{root} has no config.json: not a Hugging Face snapshot")
        raw_config = _load_json(config_path)
        config = TextConfig.from_checkpoint_config(raw_config)
        form: Form = "qwen4_exp" if raw_config["model_type"] == "qwen4_exp" else "qwen4_exp_text"
        checkpoint = cls(root, repo_id, config, raw_config, form, _detect_quantization(root, raw_config),
                         _index_tensors(root))
        checkpoint._check_tensors()
        return checkpoint

    @property
    def has_mtp(self) -> bool:
        return any(key.startswith("mtp.") for key in self.entries)

    @property
    def files(self) -> list[str]:
        return sorted({entry.file for entry in self.entries.values()})

    def has(self, canonical: str) -> bool:
        return checkpoint_key(canonical, self.form) in self.entries

    def tensor(self, canonical: str) -> torch.Tensor:
        return self.raw(checkpoint_key(canonical, self.form))

    def raw(self, key: str) -> torch.Tensor:
        """The stored tensor `key`, read from its shard (a fresh tensor, no mapping kept)."""
        entry = self.entries[key]
        return self._read(key, entry.offset, entry.length, entry.shape)

    def row_blocks(self, canonical: str, block_bytes: int = 64 << 20) -> Iterator[torch.Tensor]:
        """Tensor `canonical` in row blocks of about `block_bytes` (embeddings are 1.3 GB each)."""
        key = checkpoint_key(canonical, self.form)
        entry = self.entries[key]
        if len(entry.shape) < 2 or entry.length <= block_bytes:
            yield self.raw(key)
            return
        rows = max(1, block_bytes * entry.shape[0] // entry.length)
        for start in range(0, entry.shape[0], rows):
            yield self.raw_rows(key, start, min(rows, entry.shape[0] - start))

    def raw_rows(self, key: str, start: int, count: int) -> torch.Tensor:
        """Rows [start, start + count) of the stored tensor `key`, reading only those bytes."""
        entry = self.entries[key]
        row_bytes = entry.length // entry.shape[0] if entry.shape and entry.shape[0] else 0
        if not 0 <= start <= start + count <= entry.shape[0]:
            raise IndexError(f"rows {start}..{start + count} outside {key} ({entry.shape[0]} rows)")
        return self._read(key, entry.offset + start * row_bytes, count * row_bytes, (count, *entry.shape[1:]))

    def _read(self, key: str, offset: int, length: int, shape: tuple[int, ...]) -> torch.Tensor:
        dtype = TORCH_DTYPES[self.entries[key].dtype]
        if length == 0:
            return torch.empty(shape, dtype=dtype)
        data = bytearray(length)
        with open(self.root / self.entries[key].file, "rb", buffering=0) as handle:
            handle.seek(offset)
            if handle.readinto(data) != length:
                raise FlashpackError(f"shard {self.entries[key].file} ended while reading {key}")
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)

    def vision_keys(self) -> list[str]:
        return sorted(key for key in self.entries if is_vision_key(key))

    def expert_parts(self, name: str) -> torch.Tensor | NVFP4Parts:
        """Expert weight `name`: a float tensor for BF16 sources, NVFP4Parts for ModelOpt NVFP4 ones."""
        if self.quantization == "bf16":
            return self.tensor(name)
        base = name.removesuffix(".weight")
        return NVFP4Parts(
            self.tensor(base + ".weight"),
            self.tensor(base + ".weight_scale"),
            float(self.tensor(base + ".weight_scale_2").float().reshape(-1)[0]),
        )

    def _check_tensors(self) -> None:
        """Every tensor the config implies is present, with the right shape and dtype."""
        for spec in iter_specs(self.config, with_mtp=self.has_mtp):
            if spec.role == "expert" and self.quantization == "nvfp4":
                self._check_nvfp4(spec)
            else:
                self._check_shape(spec.name, spec.shape, FLOAT_DTYPES if spec.role != "ple_buffer" else None)
        known = {checkpoint_key(s.name, self.form) for s in iter_specs(self.config, with_mtp=self.has_mtp)}
        stray = [k for k in self.entries if k not in known and not is_vision_key(k) and not _is_quant_aux(k)]
        if stray:
            raise FlashpackError(f"checkpoint has {len(stray)} tensors the config does not explain, e.g. {stray[0]}")

    def _check_nvfp4(self, spec: TensorSpec) -> None:
        out, inp = spec.shape
        base = spec.name.removesuffix(".weight")
        self._check_shape(base + ".weight", (out, inp // 2), (torch.uint8,))
        self._check_shape(base + ".weight_scale", (out, inp // 16), (torch.float8_e4m3fn,))
        self._check_shape(base + ".weight_scale_2", None, (torch.float32,))

    def _check_shape(self, canonical: str, shape: tuple[int, ...] | None, dtypes: tuple | None) -> None:
        key = checkpoint_key(canonical, self.form)
        if key not in self.entries:
            raise FlashpackError(f"checkpoint lacks tensor {key}")
        stored = self.entries[key]
        got_shape = stored.shape
        if shape is not None and got_shape != tuple(shape):
            raise FlashpackError(f"{key} has shape {list(got_shape)} but the config implies {list(shape)}")
        if shape is None and math.prod(got_shape) != 1:
            raise FlashpackError(f"{key} should be a scalar, has shape {list(got_shape)}")
        got_dtype = TORCH_DTYPES.get(stored.dtype)
        if dtypes is not None and got_dtype not in dtypes:
            wanted = "/".join(str(d).removeprefix("torch.") for d in dtypes)
            raise FlashpackError(f"{key} has dtype {stored.dtype}, expected {wanted}")


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes sit in its shard."""

    file: str
    dtype: str  # safetensors name, e.g. BF16
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    length: int


_QUANT_AUX_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")


def _is_quant_aux(key: str) -> bool:
    return key.endswith(_QUANT_AUX_SUFFIXES)


def _detect_quantization(root: Path, raw_config: dict) -> str:
    quant, where = raw_config.get("quantization_config"), "config.json quantization_config"
    if quant is None and (root / "hf_quant_config.json").exists():
        document = _load_json(snapshot_file(root, "hf_quant_config.json", "quantization file"))
        quant = document.get("quantization", {}) if isinstance(document, dict) else document
        where = "hf_quant_config.json quantization"
    if quant is None:
        return "bf16"
    if not isinstance(quant, dict):
        raise FlashpackError(f"{where} must be an object, got {quant!r}")
    algo = str(quant.get("quant_algo", "")).upper()
    method = str(quant.get("quant_method", "modelopt")).lower()
    if method != "modelopt" or algo != "NVFP4":
        raise FlashpackError(f"unsupported quantization {method}/{algo}: flashpack reads BF16/FP16/FP32 or ModelOpt NVFP4")
    if quant.get("group_size", 16) != 16:
        raise FlashpackError(f"NVFP4 group_size {quant.get('group_size')!r} is not 16")
    return "nvfp4"


def _index_tensors(root: Path) -> dict[str, StoredTensor]:
    weight_map = _weight_map(root)
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
    elif (root / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FlashpackError(f"{root} has neither model.safetensors.index.json nor model.safetensors")
    entries: dict[str, StoredTensor] = {}
    for file in files:
        data_start, header = read_safetensors_header(snapshot_file(root, file, "shard"))
        for key, entry in header.items():
            begin, end = entry["data_offsets"]
            entries[key] = StoredTensor(file, entry["dtype"], tuple(entry["shape"]), data_start + begin, end - begin)
    if weight_map is not None:
        missing = [key for key, file in weight_map.items() if key not in entries or entries[key].file != file]
        if missing:
            raise FlashpackError(f"index names {missing[0]} in {weight_map[missing[0]]}, which does not hold it")
    return entries


def _weight_map(root: Path) -> dict[str, str] | None:
    """The index's tensor -> shard map (None without an index), its shape and names checked."""
    name = "model.safetensors.index.json"
    if not (root / name).exists():
        return None
    index = _load_json(snapshot_file(root, name, "index"))
    if not isinstance(index, dict):
        raise FlashpackError(f"{name} must be a JSON object, got {type(index).__name__}")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise FlashpackError(f"{name} has no weight_map object")
    for key, file in weight_map.items():
        if not isinstance(file, str):
            raise FlashpackError(f"{name} maps {key} to {file!r}, not a shard file name")
        snapshot_file(root, file, "shard")
    return weight_map


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except ValueError as error:
        raise FlashpackError(f"{path.name} is not valid JSON: {error}") from None
