"""hc_mix_triton against the module it replaces, `GatedResidual.mix` (runtime/model/hyper_connection.py).

Tolerance: in float32 both compute the same sums in another order: max abs error <= 1e-5 * max
|reference| for the block input, 1e-6 absolute for the injection weights (sigmoids in (0, 2)). In
bfloat16 the module rounds after every step and the kernels once: 2^-6 relative. Observed under
the interpreter: 1.5e-7 and 2.4e-7 in float32, 6.6e-3 in bfloat16. Shapes are odd
(H = 80 is no multiple of the 32-wide blocks used here, the rank 12 no power of two) so every
masked tail runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashpack.runtime.model.hyper_connection import GatedResidual

pytest.importorskip("triton")

HC, HIDDEN, RANK = 4, 80, 12
BLOCKS = dict(block_rows=4, block_h=32, block_j=16)


class _Source:
    """The few dense tensors a GatedResidual reads, random (norm weights around 0: applied as 1 + w)."""

    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.config = SimpleNamespace(hc_count=HC, hidden_size=HIDDEN, rms_norm_eps=1e-6)
        self.tensors = {
            "hc_norm.weight": 0.1 * torch.randn(HC * HIDDEN, generator=gen),
            "input_mix_weight_down.weight": torch.randn(RANK, HC * HIDDEN, generator=gen) / HIDDEN**0.5,
            "block_inject_weight.weight": torch.randn(HC, HC * HIDDEN, generator=gen) / HIDDEN**0.5,
            "input_mix_weight_up.weight": torch.randn(HC * HIDDEN, RANK, generator=gen) / RANK**0.5,
        }

    def dense(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _mixer(device, dtype, inject: bool, seed: int = 0) -> GatedResidual:
    source = _Source(seed)
    return GatedResidual(source.config, source, "", dtype, device, inject=inject)


def _fused(mixer: GatedResidual, streams: torch.Tensor):
    from flashpack.runtime.kernels.hc_mix import hc_mix_triton

    return hc_mix_triton(streams, mixer.norm.weight, mixer.norm.eps, mixer.in_proj.weight, mixer.mix_up.weight, mixer.hc,
                         mixer.inject, **BLOCKS)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("inject", [True, False], ids=["block", "final-mixer"])
def test_matches_the_module_in_float32(triton_device, tokens, inject):
    mixer = _mixer(triton_device, torch.float32, inject)
    streams = 3 * torch.randn(tokens, HC * HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(triton_device)
    want_input, want_inject = mixer.mix(streams)
    got_input, got_inject = _fused(mixer, streams)
    assert got_input.shape == want_input.shape and got_input.dtype == torch.float32
    assert _relative(got_input, want_input) <= 1e-5
    if inject:
        assert float((got_inject - want_inject).abs().max()) <= 1e-6
    else:
        assert got_inject is None and want_inject is None


def test_bfloat16_and_the_module_switch(triton_device):
    """`fused` routes a one-token mix through the kernels, in the engine dtype, injection included."""
    mixer = _mixer(triton_device, torch.bfloat16, inject=True, seed=1)
    streams = torch.randn(1, HC * HIDDEN, generator=torch.Generator().manual_seed(5)).to(triton_device, torch.bfloat16)
    want_input, want_inject = mixer.mix(streams)
    mixer.fused = True
    got_input, got_inject = mixer.mix(streams)
    assert got_input.dtype == got_inject.dtype == torch.bfloat16
    assert _relative(got_input, want_input) <= 2.0**-6
    assert _relative(got_inject, want_inject) <= 2.0**-6


def test_control_a_wrong_norm_weight_is_caught(triton_device):
    """A check that can fail: the norm applied as w instead of 1 + w must not pass."""
    mixer = _mixer(triton_device, torch.float32, inject=True, seed=2)
    streams = torch.randn(1, HC * HIDDEN, generator=torch.Generator().manual_seed(6)).to(triton_device)
    want_input, _ = mixer.mix(streams)
    from flashpack.runtime.kernels.hc_mix import hc_mix_triton

    wrong, _ = hc_mix_triton(streams, mixer.norm.weight - 1, mixer.norm.eps, mixer.in_proj.weight, mixer.mix_up.weight,
                             mixer.hc, True, **BLOCKS)
    assert _relative(wrong, want_input) > 1e-2


def test_shapes_that_do_not_fit_are_refused(triton_device):
    mixer = _mixer(triton_device, torch.float32, inject=True)
    from flashpack.runtime.kernels.hc_mix import hc_mix_triton

    with pytest.raises(ValueError, match="do not fit hc=4"):
        hc_mix_triton(torch.zeros(1, HC * HIDDEN, device=triton_device), mixer.norm.weight, 1e-6,
                      mixer.in_proj.weight, mixer.mix_up.weight, mixer.hc, inject=False)
