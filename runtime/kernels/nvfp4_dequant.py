"""In-register NVFP4 decoding shared by the Triton expert kernels (Hopper has no FP4 instructions).

An E2M1 code (sign in bit 3, magnitude index in bits 0-2) placed at bits 9-11 of a float16, sign at
bit 15, is that value times 2^-14: exponent bits 10-11 and mantissa bit 9 line up with E2M1's, and
code 1 (0.5) lands on the float16 subnormal 2^-15. So one shift-and-or and one exact f16 -> f32
convert decode a nibble, and the 2^14 is folded into the block scale (`block_scale_f32`). Float16
subnormals convert exactly on the GPU and under the interpreter (numpy float16).

The product E2M1 * FP8 block scale has at most 2 + 4 significant bits, so it is exact in bfloat16:
kernels dequantise to bf16 tensor-core operands without rounding and apply the float32 global scale
to the float32 accumulator.
"""

from __future__ import annotations

import triton
import triton.language as tl

E2M1_TO_F16_SHIFT = 16384.0  # 2^14, undoes the float16 exponent bias offset


@triton.jit
def e2m1_low_high(packed):
    """uint8 [...] -> (float32 [...] of the low nibbles, float32 [...] of the high), each / 2^14.

    Byte j of a row holds elements 2j (low) and 2j+1 (high)."""
    b = packed.to(tl.uint16)
    low = ((b & 0x7) << 9) | ((b & 0x8) << 12)
    high = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    return low.to(tl.float16, bitcast=True).to(tl.float32), high.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def block_scale_f32(scale_bytes):
    """uint8 [...] holding float8_e4m3fn block scales -> float32 [...] times 2^14, ready to multiply
    `e2m1_low_high` values. Kernels load scales as bytes so masked lanes can default to 0 (the
    interpreter cannot cast a fill value to fp8, and a garbage fp8 lane could be NaN)."""
    return scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
