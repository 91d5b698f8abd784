"""The zero-centred RMS norm (runtime/model/norms.py, `rms_norm`) in one kernel.

The module's code is ten operations, seven of them kernels (the float copy, the square, the
mean, the rsqrt of it plus eps, the scale, 1 + w and its product, the cast back), each a launch from
the host in a step run eagerly: a prompt's layer takes its norms in every hyper-connection mix,
in attention's q and k and in the PLE's, ~36 of the host's operations a layer in a live hit
(profile-live-hit-unbounded-16layers-run93-h100.txt: 580 on 16 layers). Here each group of `group_size` elements (a row, or with `group_size` each H-wide
stream of a hyper-connection row) is one program: its sum of squares, its scale and (1 + w) in
float32, stored once in x's dtype. It sums the squares in another order than torch's mean, so the
two agree to float32 rounding, not bit for bit (tests/kernels/test_rms_norm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, eps, groups_a_row, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    group = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < GROUP
    x = tl.load(x_ptr + group * GROUP + cols, mask=inside, other=0).to(tl.float32)
    w = tl.load(weight_ptr + (group % groups_a_row) * GROUP + cols, mask=inside, other=0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / GROUP + eps)
    tl.store(out_ptr + group * GROUP + cols, (x * scale * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=inside)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None) -> torch.Tensor:
    """x [..., D] -> x / rms(x) * (1 + weight) in x's dtype, the rms over each `group_size` elements
    of D (None: all of D), as norms.rms_norm."""
    width = x.shape[-1]
    group = width if group_size is None else group_size
    if width % group or weight.shape != (width,):
        raise ValueError(f"x [..., {width}] with weight {tuple(weight.shape)} and group {group} do not fit")
    x = x.contiguous()
    out = torch.empty_like(x)
    count = x.numel() // group
    if count:
        block = triton.next_power_of_2(group)
        _rms_norm_kernel[(count,)](x, weight, out, eps, width // group, GROUP=group, BLOCK=block,
                                   num_warps=8 if block >= 2048 else 4)
    return out
