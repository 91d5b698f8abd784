"""Test cases for the kernel tests: NVFP4 record pools, routings, and the error measure."""

from __future__ import annotations

import torch

from flashpack.convert.nvfp4 import quantize_nvfp4
from flashpack.layout.records import PROJECTIONS, RecordGeometry, encode_record

POISON_BYTE = 0x7F  # as a block scale: NaN; four of them as a global scale: 3.4e38


def make_pool(hidden: int, inter: int, experts: int, seed: int, swap_nibbles: bool = False) -> torch.Tensor:
    """uint8 [experts, stride]: records of random N(0, 1) experts quantised to NVFP4, padding poisoned."""
    geometry = RecordGeometry(hidden, inter)
    generator = torch.Generator().manual_seed(seed)
    pool = torch.full((experts, geometry.stride), POISON_BYTE, dtype=torch.uint8)
    for e in range(experts):
        parts = {}
        for projection, shape in geometry.shapes().items():
            q = quantize_nvfp4(torch.randn(shape, generator=generator))
            nibbles = q.packed
            if swap_nibbles:
                nibbles = (nibbles << 4) | (nibbles >> 4)
            parts[projection] = (nibbles.numpy().tobytes(), q.block_scale.view(torch.uint8).numpy().tobytes(),
                                 float(q.global_scale))
        assert list(parts) == list(PROJECTIONS)
        record = encode_record(geometry, parts)
        pool[e, :len(record)] = torch.frombuffer(bytearray(record), dtype=torch.uint8)
    return pool


def routing(tokens: int, experts: int, top_k: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [T, K] int32, distinct per token; weights [T, K] float32 summing to 1 per token)."""
    generator = torch.Generator().manual_seed(seed)
    slots = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator) + 0.1
    return slots.to(torch.int32).to(device), (weights / weights.sum(-1, keepdim=True)).to(device)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: one number per tensor, as the tolerances are stated."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def nan_like(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
