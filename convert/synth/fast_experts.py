"""Fast NVFP4 experts for benchmark snapshots: random blocks drawn from quantised reference blocks.

The sampled path (tensor_plan's `sampled_expert`) draws every expert's BF16 values and quantises
them, some 60 ms of CPU an expert at real width, for 83 % of a 16-layer snapshot's bytes. A
benchmark needs those bytes, the layout and realistic magnitudes, not the particular values. So one
reference expert of each shape and init distribution is sampled and quantised exactly as the
sampled path does it, and its 16-element blocks, each 8 code bytes (16 E2M1 codes) with its FP8
block scale, form a pool together with their negations. Every expert tensor is then a uniform random
draw of blocks from that pool, under the reference's global scale (gate and up share one, as
ModelOpt fuses them). Each block keeps the codes its scale was chosen for (its largest value near 6
times the scale), and block scales and decoded values follow the reference's distributions up to the
noise of drawing; only the global scale no longer varies from expert to expert as sampled experts'
amax does (about +-7 %). A tensor costs one random index a block and two gathers: about 4 ms an
expert on one core.

The router skew zeroes down_proj's row of the massive channel; the drawn tensors zero the same rows
(zero codes, zero block scales, as the quantiser writes an all-zero row), so the channel survives
every layer and routing is skewed exactly as in the sampled path.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from flashpack.layout.checkpoint_spec import EXPERT_PROJECTIONS, TensorSpec
from flashpack.convert.nvfp4 import quantize_nvfp4
from flashpack.convert.synth.init_values import ValueSource, block_seed, text_distribution
from flashpack.convert.synth.nvfp4_experts import QuantizedExpert, modelopt_tensors
from flashpack.layout.nvfp4 import NVFP4_BLOCK, NVFP4Tensor

# Bits 0-2 of every nibble (the magnitude) and bit 0 of every nibble, over a block's 8 bytes.
_MAGNITUDE_BITS = 0x7777777777777777
_LOW_BITS = 0x1111111111111111


@dataclass(frozen=True)
class BlockPool:
    """Quantised 16-element blocks to draw tensors from, under one global scale."""

    codes: torch.Tensor  # int64 [n]: a block's 8 code bytes, element 2i in the low nibble
    scales: torch.Tensor  # uint8 [n]: its float8_e4m3fn block scale's bits
    global_scale: torch.Tensor  # float32 scalar

    @classmethod
    def of(cls, quantized: NVFP4Tensor) -> BlockPool:
        """The blocks of `quantized` and their negations."""
        codes = quantized.packed.contiguous().view(torch.int64).reshape(-1)
        scales = quantized.block_scale.contiguous().view(torch.uint8).reshape(-1)
        return cls(torch.cat([codes, negate_codes(codes)]), torch.cat([scales, scales]), quantized.global_scale)

    def draw(self, shape: tuple[int, int], generator: torch.Generator, zero_rows: Iterable[int] = ()) -> NVFP4Tensor:
        """An NVFP4 tensor of float shape [out, in] (in a multiple of 16), blocks drawn uniformly."""
        rows, blocks = shape[0], shape[1] // NVFP4_BLOCK
        index = torch.randint(len(self.codes), (rows * blocks,), generator=generator, dtype=torch.int32)
        packed = self.codes.index_select(0, index).view(torch.uint8).view(rows, blocks * NVFP4_BLOCK // 2)
        scale = self.scales.index_select(0, index).view(rows, blocks)
        for row in zero_rows:
            packed[row] = 0
            scale[row] = 0  # float8 +0
        return NVFP4Tensor(packed, scale.view(torch.float8_e4m3fn), self.global_scale)


def negate_codes(codes: torch.Tensor) -> torch.Tensor:
    """int64 blocks of E2M1 codes with every nonzero code's sign flipped (bit 3 of its nibble); zeros
    stay +0, as the quantiser writes them."""
    magnitude = codes & _MAGNITUDE_BITS
    nonzero = (magnitude | (magnitude >> 1) | (magnitude >> 2)) & _LOW_BITS
    return codes ^ (nonzero << 3)


class FastExperts:
    """Makes each expert's ModelOpt tensors from block pools: `expert(specs, scratch)` stands in for
    the sampled path's `sampled_expert` and, like it, may run on any thread."""

    def __init__(self, values: ValueSource, specs_by_expert: Iterable[list[TensorSpec]]):
        self._seed = values.seed
        self._nominal_layers = values.nominal_layers
        self._adjuster = values.adjuster
        # The reference is the unadjusted values: rows the skew zeroes are zeroed per drawn tensor.
        plain = ValueSource(values.cfg, values.seed, values.nominal_layers)
        self._pools: dict[tuple, tuple[BlockPool, BlockPool]] = {}
        for specs in specs_by_expert:  # checkpoint order: layer 0's expert 0 is every kind's reference
            kind = self._kind(specs)
            if kind not in self._pools:
                self._pools[kind] = _reference_pools(plain, _by_projection(specs))

    def expert(self, specs: list[TensorSpec], scratch: threading.local | None = None) -> QuantizedExpert:
        gate_up_pool, down_pool = self._pools[self._kind(specs)]
        parts = {}
        for projection, spec in _by_projection(specs).items():
            pool = down_pool if projection == "down_proj" else gate_up_pool
            generator = torch.Generator().manual_seed(block_seed(self._seed, "nvfp4_blocks/" + spec.name, 0))
            parts[projection] = pool.draw(spec.shape, generator, self._zeroed_rows(spec))
        return modelopt_tensors(parts)

    def _kind(self, specs: list[TensorSpec]) -> tuple:
        return tuple(
            (spec.shape, text_distribution(spec.name, spec.shape, self._nominal_layers))
            for spec in _by_projection(specs).values()
        )

    def _zeroed_rows(self, spec: TensorSpec) -> list[int]:
        """Rows the adjuster zeroes in `spec`, found by adjusting a column of ones; any other edit
        cannot be expressed by drawn blocks, so it is an error."""
        if self._adjuster is None:
            return []
        probe = self._adjuster.adjust(spec.name, 0, torch.ones(spec.shape[0], 1))
        zero = probe[:, 0] == 0
        if not torch.all(zero | (probe[:, 0] == 1)):
            raise ValueError(f"fast experts cannot express the adjustment of {spec.name}")
        return zero.nonzero()[:, 0].tolist()


def _by_projection(specs: list[TensorSpec]) -> dict[str, TensorSpec]:
    by_projection = {spec.projection: spec for spec in specs}
    return {projection: by_projection[projection] for projection in EXPERT_PROJECTIONS}


def _reference_pools(values: ValueSource, specs: dict[str, TensorSpec]) -> tuple[BlockPool, BlockPool]:
    """(gate and up's pool, down's pool) from one expert quantised as the sampled path does."""
    gate, up, down = (specs[projection] for projection in EXPERT_PROJECTIONS)
    gate_up = torch.empty((gate.shape[0] + up.shape[0], gate.shape[1]), dtype=torch.bfloat16)
    values.text_into(gate, gate_up[: gate.shape[0]])
    values.text_into(up, gate_up[gate.shape[0]:])
    down_values = values.text_into(down, torch.empty(down.shape, dtype=torch.bfloat16))
    return BlockPool.of(quantize_nvfp4(gate_up)), BlockPool.of(quantize_nvfp4(down_values))

