"""Read a safetensors shard's header and check it before trusting a byte of it.

The header is JSON the shard's author controls, and every entry in it becomes a seek and a read
size. So the header must be a JSON object; each tensor entry an object with a dtype flashpack
reads (layout/dtypes.py), a shape of non-negative integers and `data_offsets` [begin, end] with
0 <= begin <= end, spanning exactly the bytes its shape and dtype need; spans may not overlap and
must end inside the file. The safetensors library checks much the same when it loads a file, but
convert reads tensors by offset without it, and its errors name neither the shard nor the tensor.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from flashpack.errors import FlashpackError
from flashpack.layout.dtypes import TORCH_DTYPES, dtype_bytes

METADATA_KEY = "__metadata__"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def read_safetensors_header(path: Path) -> tuple[int, dict[str, dict]]:
    """(offset where tensor data starts, tensor entries) of a shard, after checking it is whole and sound."""
    if not path.is_file():
        raise FlashpackError(f"shard {path.name} is missing from {path.parent}")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise FlashpackError(f"shard {path.name} is truncated ({size} bytes)")
        header_length = struct.unpack("<Q", prefix)[0]
        if header_length > size - 8:
            raise FlashpackError(f"shard {path.name} is truncated: header claims {header_length} bytes, file has {size}")
        if header_length > MAX_HEADER_BYTES:
            raise FlashpackError(f"shard {path.name} is not safetensors: a header of {header_length} bytes")
        try:
            header = json.loads(handle.read(header_length))
        except ValueError:
            raise FlashpackError(f"shard {path.name} has a corrupt header") from None
    if not isinstance(header, dict):
        raise FlashpackError(f"shard {path.name} is not safetensors: its header is not a JSON object")
    metadata = header.pop(METADATA_KEY, None)
    if metadata is not None and not isinstance(metadata, dict):
        raise FlashpackError(f"shard {path.name} is not safetensors: {METADATA_KEY} is not an object")
    for key, entry in header.items():
        _check_entry(path.name, key, entry)
    _check_spans(path.name, header)
    data_end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if 8 + header_length + data_end > size:
        raise FlashpackError(
            f"shard {path.name} is truncated: {size} bytes, its header needs {8 + header_length + data_end}"
        )
    return 8 + header_length, header


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_entry(shard: str, key: str, entry: Any) -> None:
    where = f"shard {shard}: tensor {key}"
    if not isinstance(entry, dict):
        raise FlashpackError(f"{where} is not safetensors: its header entry is {type(entry).__name__}, not an object")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in TORCH_DTYPES:
        raise FlashpackError(f"{where} has dtype {dtype!r}, which flashpack does not read ({', '.join(TORCH_DTYPES)})")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise FlashpackError(f"{where} has shape {shape!r}: expected a list of non-negative integers")
    offsets = entry.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise FlashpackError(f"{where} has data_offsets {offsets!r}: expected [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise FlashpackError(f"{where} has data_offsets {offsets}: expected 0 <= begin <= end")
    needed = math.prod(shape) * dtype_bytes(dtype)
    if end - begin != needed:
        raise FlashpackError(f"{where} spans {end - begin} bytes, but {dtype} {shape} needs {needed}")


def _check_spans(shard: str, header: dict[str, dict]) -> None:
    """No two tensors share bytes (an empty tensor shares none)."""
    spans = sorted((entry["data_offsets"][0], entry["data_offsets"][1], key) for key, entry in header.items())
    reach, reached_by = 0, None
    for begin, end, key in spans:
        if begin < reach and begin < end:
            raise FlashpackError(f"shard {shard}: tensors {reached_by} and {key} overlap")
        if end > reach:
            reach, reached_by = end, key
