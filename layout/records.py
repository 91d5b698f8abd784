"""Expert records: where each part of one expert sits inside its record, and how to decode it.

A record is gate, up and down nibbles, then their FP8 block scales, then a 16-byte trailer of the
three float32 global scales and the magic b"FPX1". Records start on 4 KiB boundaries so one
O_DIRECT read of `stride` bytes loads exactly one expert. FORMAT.md is the normative text.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import xxhash

from flashpack.errors import PackDamageError
from flashpack.layout.nvfp4 import NVFP4_BLOCK, dequantize_nvfp4

PAGE = 4096
RECORD_MAGIC = b"FPX1"
TRAILER = struct.Struct("<fff4s")
PROJECTIONS = ("gate", "up", "down")


def align_up(value: int, alignment: int = PAGE) -> int:
    return -(-value // alignment) * alignment


def record_hash(data: bytes | memoryview) -> str:
    """xxHash64 (seed 0) of a record's `length` bytes, as 16 lowercase hex digits."""
    return xxhash.xxh64(data).hexdigest()


@dataclass(frozen=True)
class RecordGeometry:
    """Byte layout of one expert record for hidden size H and expert width I."""

    hidden: int
    intermediate: int

    def shapes(self) -> dict[str, tuple[int, int]]:
        """[out, in] of each projection, like nn.Linear."""
        h, i = self.hidden, self.intermediate
        return {"gate": (i, h), "up": (i, h), "down": (h, i)}

    def parts(self) -> list[tuple[str, int, int]]:
        """(part name, offset, length) in record order."""
        parts, offset = [], 0
        for kind, divisor in (("nibbles", 2), ("scales", NVFP4_BLOCK)):
            for projection, (out, inp) in self.shapes().items():
                length = out * inp // divisor
                parts.append((f"{projection}_{kind}", offset, length))
                offset += length
        parts.append(("trailer", offset, TRAILER.size))
        return parts

    @property
    def data_bytes(self) -> int:
        """Nibbles and block scales: 2,764,800 for the real model (exactly 675 pages)."""
        return self.length - TRAILER.size

    @property
    def length(self) -> int:
        name, offset, length = self.parts()[-1]
        return offset + length

    @property
    def stride(self) -> int:
        return align_up(self.length)


@dataclass(frozen=True)
class DecodedExpert:
    """One expert's NVFP4 parts, views into the record buffer (no copies)."""

    nibbles: dict[str, torch.Tensor]  # uint8 [out, in/2]
    scales: dict[str, torch.Tensor]  # float8_e4m3fn [out, in/16]
    global_scales: dict[str, float]

    def dequantize(self, projection: str) -> torch.Tensor:
        return dequantize_nvfp4(
            self.nibbles[projection], self.scales[projection], self.global_scales[projection]
        )


def encode_record(geometry: RecordGeometry, parts: dict[str, tuple[bytes, bytes, float]]) -> bytes:
    """Bytes of one record (without page padding) from {projection: (nibbles, scales, global)}."""
    out = bytearray()
    for index in (0, 1):
        for projection in PROJECTIONS:
            out += parts[projection][index]
    globals_ = [parts[p][2] for p in PROJECTIONS]
    out += TRAILER.pack(*globals_, RECORD_MAGIC)
    if len(out) != geometry.length:
        raise ValueError(f"record is {len(out)} bytes, geometry says {geometry.length}")
    return bytes(out)


def decode_record(geometry: RecordGeometry, buffer: torch.Tensor, where: str = "record") -> DecodedExpert:
    """uint8 [>= length] -> DecodedExpert viewing `buffer`; raises on a bad trailer."""
    layout = {name: (offset, length) for name, offset, length in geometry.parts()}
    offset, length = layout["trailer"]
    *global_values, magic = TRAILER.unpack(bytes(buffer[offset:offset + length].tolist()))
    if magic != RECORD_MAGIC:
        raise PackDamageError(f"{where}: bad record trailer (magic {magic!r}); the pack is corrupt")
    nibbles, scales = {}, {}
    for projection, (out, inp) in geometry.shapes().items():
        offset, length = layout[f"{projection}_nibbles"]
        nibbles[projection] = buffer[offset:offset + length].view(out, inp // 2)
        offset, length = layout[f"{projection}_scales"]
        scales[projection] = buffer[offset:offset + length].view(torch.float8_e4m3fn).view(out, inp // NVFP4_BLOCK)
    return DecodedExpert(nibbles, scales, dict(zip(PROJECTIONS, global_values)))
