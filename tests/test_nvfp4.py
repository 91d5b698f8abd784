"""The NVFP4 / FP8 codecs against plain definitions, with stated bounds and a control that breaks."""

import torch

from flashpack.convert.nvfp4 import (
    fp8_rows_error_bound,
    nvfp4_error_bound,
    quantize_fp8_rows,
    quantize_nvfp4,
)
from flashpack.layout.nvfp4 import E2M1_MAGNITUDES, dequantize_fp8_rows, dequantize_nvfp4


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
