"""rms_norm_triton (runtime/kernels/rms_norm.py) against norms.rms_norm, its reference: float32 within
2e-6 relative (the sum of squares in another order), bfloat16 within one bf16 step of the
reference's own rounding (2^-7 of a value at most: a float32 result near a rounding boundary may
round to the neighbour), on rows and on grouped rows (a hyper-connection row's streams)
with odd widths; a weight applied as w rather than 1 + w must fail. On the GPU where there is one,
else in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from flashpack.runtime.model.norms import rms_norm

pytest.importorskip("triton")


def _inputs(shape, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=generator) * 3).to(device, dtype)
    weight = (torch.randn(shape[-1], generator=generator) * 0.1).to(device, dtype)
    return x, weight


@pytest.mark.parametrize("shape,group", [((5, 96), None), ((3, 4, 24), None), ((7, 4 * 40), 40), ((1, 2 * 100), 100),
                                         ((0, 32), None)])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 2 ** -7)])
def test_the_kernel_computes_the_reference(triton_device, shape, group, dtype, tolerance):
    from flashpack.runtime.kernels.rms_norm import rms_norm_triton

    x, weight = _inputs(shape, dtype, triton_device)
    found = rms_norm_triton(x, weight, 1e-6, group)
    expected = rms_norm(x, weight, 1e-6, group)
    assert found.dtype == dtype and found.shape == x.shape
    if x.numel():
        assert float(((found.float() - expected.float()).abs() / expected.float().abs().clamp_min(1e-3)).max()) <= tolerance


def test_control_a_weight_applied_as_is_fails(triton_device):
    """The check can fail: the reference with w where (1 + w) belongs is far from the kernel."""
    from flashpack.runtime.kernels.rms_norm import rms_norm_triton

    x, weight = _inputs((5, 96), torch.float32, triton_device)
    found = rms_norm_triton(x, weight, 1e-6)
    wrong = rms_norm(x, weight - 1, 1e-6)  # (1 + (w - 1)) = w
    assert float((found - wrong).abs().max()) > 0.1


def test_a_group_that_does_not_divide_the_row_is_refused(triton_device):
    from flashpack.runtime.kernels.rms_norm import rms_norm_triton

    x, weight = _inputs((2, 90), torch.float32, triton_device)
    with pytest.raises(ValueError, match="do not fit"):
        rms_norm_triton(x, weight, 1e-6, 40)
