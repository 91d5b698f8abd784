"""Sharded safetensors written tensor by tensor, block by block, in bounded memory.

Every tensor's dtype and shape is known before its values exist, so each shard's header goes
first and the values stream after it in header order; nothing larger than one block is ever
held. Layout per file, as the safetensors library reads it: 8-byte little-endian header length,
JSON header (dtype, shape, [begin, end) data offsets; padded with spaces to 8 bytes), raw bytes.
`model.safetensors.index.json` maps every key to its shard, as transformers expects.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.uint8: "U8",
    torch.int64: "I64",
}
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class DiskTensor:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], Iterator[torch.Tensor]]  # blocks whose concatenation along dim 0 is the tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(tensors: list[DiskTensor], shard_bytes: int) -> list[list[DiskTensor]]:
    """Greedy split in order; a tensor larger than a shard gets a shard of its own."""
    shards: list[list[DiskTensor]] = [[]]
    filled = 0
    for tensor in tensors:
        if shards[-1] and filled + tensor.nbytes > shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(tensor)
        filled += tensor.nbytes
    return shards


def write_sharded(folder: Path, tensors: list[DiskTensor], shard_bytes: int) -> dict:
    """Write every tensor into `folder`; returns (and writes) the index."""
    keys = [tensor.key for tensor in tensors]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate tensor keys in the synthetic checkpoint")
    shards = plan_shards(tensors, shard_bytes)
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(folder / name, shard)
        weight_map.update({tensor.key: name for tensor in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return index


def _write_shard(path: Path, shard: list[DiskTensor]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    cursor = 0
    for tensor in shard:
        header[tensor.key] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [cursor, cursor + tensor.nbytes],
        }
        cursor += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for tensor in shard:
            _write_tensor(out, tensor)


def _write_tensor(out, tensor: DiskTensor) -> None:
    written = 0
    for block in tensor.produce():
        if block.dtype != tensor.dtype or (block.dim() and tuple(block.shape[1:]) != tensor.shape[1:]):
            raise ValueError(f"{tensor.key}: block {block.dtype}{list(block.shape)} does not fit {tensor.dtype}{list(tensor.shape)}")
        data = block.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        out.write(data)
        written += data.nbytes
    if written != tensor.nbytes:
        raise ValueError(f"{tensor.key}: wrote {written} bytes, expected {tensor.nbytes}")
