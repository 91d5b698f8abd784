"""Write a safetensors file one tensor at a time, in bounded memory.

The `safetensors` library only saves a whole dict of tensors at once, which for a 10 GB dense
part (or a 5 GB checkpoint shard) means holding it all in RAM. The format is simple enough to
stream: an 8-byte little-endian header length, a JSON header naming every tensor's dtype, shape
and data offsets, then the raw bytes in header order. All shapes are known before the first byte,
so the header goes first and each tensor is appended as it is produced. Files this writes are read
back with the `safetensors` library in the tests.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from collections.abc import Iterable
from typing import BinaryIO

import torch

from flashpack.layout.dtypes import SAFETENSORS_NAMES, dtype_bytes

_HEADER_ALIGNMENT = 8


class StreamingSafetensorsWriter:
    """Declare every tensor up front, then `write` each in declaration order.

    offsets(name) gives absolute file offsets, which the pack manifest records.
    """

    def __init__(self, path: Path, tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None):
        self.path = path
        self._order = [name for name, _, _ in tensors]
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        cursor = 0
        self._specs: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, dtype, shape in tensors:
            length = dtype_bytes(dtype) * math.prod(shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [cursor, cursor + length]}
            self._specs[name] = (dtype, tuple(shape), cursor, length)
            cursor += length
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % _HEADER_ALIGNMENT)
        self.data_start = 8 + len(encoded)
        self.total_bytes = self.data_start + cursor
        self._file: BinaryIO = open(path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self._next = 0

    def offsets(self, name: str) -> tuple[int, int]:
        """(absolute offset, length) of `name` in the finished file."""
        _, _, start, length = self._specs[name]
        return self.data_start + start, length

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.write_blocks(name, [tensor])

    def write_blocks(self, name: str, blocks: Iterable[torch.Tensor]) -> None:
        """Write `name` from blocks whose concatenation along dim 0 is the tensor (bounded memory)."""
        if self._next >= len(self._order) or self._order[self._next] != name:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing"
            raise ValueError(f"tensors must be written in declaration order: got {name}, expected {expected}")
        dtype, shape, _, length = self._specs[name]
        written = 0
        for block in blocks:
            if SAFETENSORS_NAMES.get(block.dtype) != dtype or (block.dim() and tuple(block.shape[1:]) != shape[1:]):
                raise ValueError(f"{name}: declared {dtype}{list(shape)}, got a {block.dtype}{list(block.shape)} block")
            data = block.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            self._file.write(data)  # numpy exposes the buffer: no extra copy
            written += data.nbytes
        if written != length:
            raise ValueError(f"{name}: wrote {written} bytes, expected {length}")
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            self._file.close()
            raise ValueError(f"{self.path.name}: only {self._next} of {len(self._order)} tensors written")
        self._file.flush()
        self._file.close()

    def __enter__(self) -> "StreamingSafetensorsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._file.close()
