"""`ExpertBank`: E experts' NVFP4 parts as [E, ...] views, the one input every expert kernel reads.

A bank is usually a device slot pool of whole records, uint8 [S, record_stride], each row one record
exactly as FORMAT.md section 3 lays it out; `ExpertBank.from_pool` makes seven strided views into it
without copying, so kernels read the record bytes where they sit. A kernel addresses expert `e` as
`part.data_ptr() + e * part.stride(0)`; only the [out, in] rows inside one expert must be contiguous.

Shapes (H = hidden size, I = expert width, E = experts in the bank):
    gate_nibbles, up_nibbles  uint8 [E, I, H/2]    element 2j in the low nibble of byte j
    down_nibbles              uint8 [E, H, I/2]
    gate_scales, up_scales    float8_e4m3fn [E, I, H/16]
    down_scales               float8_e4m3fn [E, H, I/16]
    global_scales             float32 [E, 3]       (gate, up, down)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashpack.layout.nvfp4 import NVFP4_BLOCK
from flashpack.layout.records import PROJECTIONS, RecordGeometry


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@dataclass(frozen=True)
class ExpertBank:
    gate_nibbles: torch.Tensor
    up_nibbles: torch.Tensor
    down_nibbles: torch.Tensor
    gate_scales: torch.Tensor
    up_scales: torch.Tensor
    down_scales: torch.Tensor
    global_scales: torch.Tensor

    def __post_init__(self) -> None:
        e, i, half_h = self.gate_nibbles.shape
        h = 2 * half_h
        expected = {
            "gate_nibbles": ((e, i, h // 2), torch.uint8), "up_nibbles": ((e, i, h // 2), torch.uint8),
            "down_nibbles": ((e, h, i // 2), torch.uint8),
            "gate_scales": ((e, i, h // NVFP4_BLOCK), torch.float8_e4m3fn),
            "up_scales": ((e, i, h // NVFP4_BLOCK), torch.float8_e4m3fn),
            "down_scales": ((e, h, i // NVFP4_BLOCK), torch.float8_e4m3fn),
            "global_scales": ((e, 3), torch.float32),
        }
        if h % NVFP4_BLOCK or i % NVFP4_BLOCK:
            raise ValueError(f"H={h} and I={i} must be multiples of {NVFP4_BLOCK}")
        for name, (shape, dtype) in expected.items():
            part = getattr(self, name)
            if tuple(part.shape) != shape or part.dtype != dtype:
                raise ValueError(f"{name}: expected {dtype} {shape}, got {part.dtype} {tuple(part.shape)}")
            if part.device != self.gate_nibbles.device:
                raise ValueError(f"{name} is on {part.device}, the bank on {self.gate_nibbles.device}")
            if part.stride()[1:] != _contiguous_strides(shape[1:]):
                raise ValueError(f"{name}: each expert's rows must be contiguous, strides {part.stride()}")
            if name.endswith("nibbles") and (part.data_ptr() % 8 or (e > 1 and part.stride(0) % 8)):
                # the decode kernels read nibbles 8 bytes (one 16-element group) at a time; records keep
                # every nibble part 8-byte aligned (offsets 0, I*H/2, I*H in 4 KiB-strided records)
                raise ValueError(f"{name}: each expert must start on an 8-byte boundary")

    @property
    def num_experts(self) -> int:
        return self.gate_nibbles.shape[0]

    @property
    def hidden(self) -> int:
        return 2 * self.gate_nibbles.shape[2]

    @property
    def intermediate(self) -> int:
        return self.gate_nibbles.shape[1]

    @property
    def device(self) -> torch.device:
        return self.gate_nibbles.device

    def nibbles(self, projection: str) -> torch.Tensor:
        return getattr(self, f"{projection}_nibbles")

    def scales(self, projection: str) -> torch.Tensor:
        return getattr(self, f"{projection}_scales")

    @classmethod
    def from_pool(cls, pool: torch.Tensor, geometry: RecordGeometry) -> "ExpertBank":
        """uint8 [S, stride >= geometry.length], one record per row -> views (no copies).

        The global scales are read in place from each record's trailer, so `stride` and the
        trailer offset must be multiples of 4 (FORMAT.md pads records to 4 KiB pages)."""
        if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] < geometry.length:
            raise ValueError(f"pool must be uint8 [S, >= {geometry.length}], got {pool.dtype} {tuple(pool.shape)}")
        if pool.stride(1) != 1 or pool.stride(0) % 4 or pool.shape[1] % 4:
            raise ValueError("pool rows must be contiguous with a stride that is a multiple of 4 bytes")
        slots, layout = pool.shape[0], {name: (offset, length) for name, offset, length in geometry.parts()}
        views = {}
        for projection, (out, inp) in geometry.shapes().items():
            offset, length = layout[f"{projection}_nibbles"]
            views[f"{projection}_nibbles"] = pool[:, offset:offset + length].view(slots, out, inp // 2)
            offset, length = layout[f"{projection}_scales"]
            views[f"{projection}_scales"] = (
                pool[:, offset:offset + length].view(torch.float8_e4m3fn).view(slots, out, inp // NVFP4_BLOCK))
        trailer, _ = layout["trailer"]
        if trailer % 4:
            raise ValueError(f"trailer offset {trailer} is not 4-byte aligned")
        words = pool.view(torch.float32)  # [S, stride / 4]; the trailer's first 3 words are the globals
        views["global_scales"] = words[:, trailer // 4:trailer // 4 + len(PROJECTIONS)]
        return cls(**views)

    @classmethod
    def from_record(cls, record: torch.Tensor, geometry: RecordGeometry) -> "ExpertBank":
        """uint8 [>= geometry.length]: one record -> a bank of one expert (E = 1)."""
        length = -(-geometry.length // 4) * 4
        if record.numel() < length:
            record = torch.cat([record, record.new_zeros(length - record.numel())])
        return cls.from_pool(record[:max(length, record.numel() // 4 * 4)].view(1, -1), geometry)
