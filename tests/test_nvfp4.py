"""The NVFP4 / FP8 codecs against plain definitions, with stated bounds and a control that breaks."""

import math

import pytest
import torch
from flashpack.convert.nvfp4 import (
    fp8_rows_error_bound,
    nvfp4_error_bound,
    quantize_fp8_rows,
    quantize_nvfp4,
)
from flashpack.layout.nvfp4 import (
    E2M1_MAGNITUDES,
    FP8_MAX,
    NVFP4_BLOCK,
    NVFP4Tensor,
    dequantize_fp8_rows,
    dequantize_nvfp4,
)

_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _weights(rows: int = 48, cols: int = 96, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator) * 0.02
    weight[3, 7] = 0.9  # an outlier block, so block scales differ widely
    weight[5, :16] = 0  # an all-zero block
    return weight


def test_nvfp4_round_trip_within_stated_bound():
    weight = _weights()
    quantized = quantize_nvfp4(weight)
    restored = dequantize_nvfp4(quantized.packed, quantized.block_scale, quantized.global_scale)
    assert quantized.packed.dtype == torch.uint8 and quantized.packed.shape == (48, 48)
    assert quantized.block_scale.dtype == torch.float8_e4m3fn and quantized.block_scale.shape == (48, 6)
    assert torch.all((restored - weight).abs() <= nvfp4_error_bound(weight))
    assert torch.all(restored[5, :16] == 0)


def test_nvfp4_decoding_matches_the_definition_element_by_element():
    weight = _weights(seed=1)
    quantized = quantize_nvfp4(weight)
    packed = quantized.packed
    table = list(E2M1_MAGNITUDES) + [-m for m in E2M1_MAGNITUDES]
    for row, col in [(0, 0), (0, 1), (3, 7), (47, 94), (47, 95), (20, 33)]:
        byte = int(packed[row, col // 2])
        nibble = byte & 0x0F if col % 2 == 0 else byte >> 4
        scale = quantized.block_scale[row, col // 16].float()
        expected = torch.tensor(table[nibble]) * scale * quantized.global_scale  # float32, in this order
        got = dequantize_nvfp4(packed, quantized.block_scale, quantized.global_scale)[row, col]
        assert float(got) == float(expected)


def test_quantising_a_dequantised_tensor_reproduces_its_bytes():
    quantized = quantize_nvfp4(_weights(seed=2))
    restored = dequantize_nvfp4(quantized.packed, quantized.block_scale, quantized.global_scale)
    again = quantize_nvfp4(restored)
    assert torch.equal(again.packed, quantized.packed)
    assert torch.equal(again.block_scale.view(torch.uint8), quantized.block_scale.view(torch.uint8))


def test_swapped_nibbles_break_the_round_trip():
    """Control: a decoder reading the high nibble first must fail the bound."""
    weight = _weights(seed=3)
    quantized = quantize_nvfp4(weight)
    swapped = (quantized.packed >> 4) | ((quantized.packed & 0x0F) << 4)
    restored = dequantize_nvfp4(swapped, quantized.block_scale, quantized.global_scale)
    assert not torch.all((restored - weight).abs() <= nvfp4_error_bound(weight))


def test_fp8_rows_within_bound():
    weight = _weights(seed=4) * 30
    values, scales = quantize_fp8_rows(weight)
    restored = dequantize_fp8_rows(values, scales)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (48,)
    assert torch.all((restored - weight).abs() <= fp8_rows_error_bound(weight))
    assert torch.all(restored[5, :16] == 0)


def _reference_quantize_nvfp4(weight: torch.Tensor) -> NVFP4Tensor:
    """The first implementation, kept as the plain definition the fast one must match bit for bit."""
    x = weight.float()
    amax = x.abs().max()
    global_scale = amax / (6.0 * FP8_MAX) if amax > 0 else torch.tensor(1.0)
    blocks = x.unflatten(-1, (-1, NVFP4_BLOCK))
    block_amax = blocks.abs().amax(dim=-1)
    block_scale = (block_amax / (6.0 * global_scale)).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    effective = block_scale.float() * global_scale
    scaled = torch.where(effective.unsqueeze(-1) > 0, blocks / effective.unsqueeze(-1), torch.zeros_like(blocks))
    scaled = scaled.flatten(-2)
    magnitude = scaled.abs()
    code = torch.zeros_like(magnitude, dtype=torch.int32)
    for index, midpoint in enumerate(_MIDPOINTS):
        above = magnitude > midpoint if index % 2 == 0 else magnitude >= midpoint
        code += above.to(torch.int32)
    sign = (scaled < 0).to(torch.int32) << 3
    codes = torch.where(code == 0, code, code | sign)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return NVFP4Tensor(packed=packed, block_scale=block_scale, global_scale=global_scale.float().reshape(()))


def _exact_ties() -> torch.Tensor:
    """Blocks whose scaled values land exactly on every midpoint, either sign, and one float32 step
    either side of it. The global scale is 2^-10 (amax 2.625 = 6 * 448 * 2^-10) and each block's
    scale is exact in FP8, so value / (block scale * global scale) is exact."""
    global_scale = 2.0**-10
    rows = []
    for block_scale in (FP8_MAX, 1.0, 3.5, 2.0**-6, 2.0**-9):
        effective = block_scale * global_scale
        ties = torch.tensor(_MIDPOINTS, dtype=torch.float64) * effective
        for nudge in (0.0, math.inf, -math.inf):
            near = ties.float() if not nudge else torch.nextafter(ties.float(), torch.tensor(nudge))
            rows.append(torch.cat([torch.tensor([6.0 * effective]), near, -near, torch.zeros(1)]).float())
    return torch.stack(rows)


def _nvfp4_cases() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    random = torch.randn(37, 160, generator=generator)
    random[2] = 0  # all-zero blocks
    random[4, :16] = random[4, :16].abs().neg()  # an all-negative block
    random[6, 16:32] = 1e-9  # a block whose FP8 scale underflows to zero next to the large ones
    wide = torch.randn(3, 1 << 17, generator=generator) * 1e-3  # rows longer than a chunk
    many = torch.randn(1000, 48, generator=generator)  # a partial last chunk
    nan = random.clone()
    nan[9, 40] = math.nan  # the reference zeroes such a block and takes the global scale as 1
    transposed = torch.randn(64, 96, generator=generator).t()  # not contiguous
    return [random, _exact_ties(), wide, many, random.bfloat16(), random.half(), torch.zeros(2, 32), nan, transposed]


@pytest.mark.parametrize("case", range(len(_nvfp4_cases())))
def test_quantize_nvfp4_matches_the_reference_bit_for_bit(case):
    weight = _nvfp4_cases()[case]
    got, want = quantize_nvfp4(weight), _reference_quantize_nvfp4(weight)
    assert torch.equal(got.packed, want.packed)
    assert torch.equal(got.block_scale.view(torch.uint8), want.block_scale.view(torch.uint8))
    assert torch.equal(got.global_scale, want.global_scale)
