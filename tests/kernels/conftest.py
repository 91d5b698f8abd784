"""Kernel tests: CUDA when present, else the Triton interpreter on the CPU, at tiny odd shapes.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET).
Records are built with the converter's own quantiser and encoder, and every pool byte outside the
records is poisoned (kernel_cases.POISON_BYTE) so a stray read shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from kernel_cases import make_pool  # noqa: E402

from flashpack.layout.records import RecordGeometry  # noqa: E402
from flashpack.runtime.kernels.bank import ExpertBank  # noqa: E402


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def triton_device(device) -> torch.device:
    """The device the Triton kernels run on here; skips if they cannot (no triton, or the kernels
    were built for the GPU on a machine without one)."""
    pytest.importorskip("triton")
    from flashpack.runtime.kernels.dispatch import kernels_interpreted

    if device.type == "cpu" and not kernels_interpreted():
        pytest.skip("kernels were imported before TRITON_INTERPRET=1 was set")
    return device


@pytest.fixture
def make_bank(device):
    """make_bank(H, I, E, seed, swap_nibbles=False) -> ExpertBank over a poisoned pool on `device`."""

    def build(hidden: int, inter: int, experts: int, seed: int = 0, swap_nibbles: bool = False) -> ExpertBank:
        pool = make_pool(hidden, inter, experts, seed, swap_nibbles).to(device)
        return ExpertBank.from_pool(pool, RecordGeometry(hidden, inter))

    return build
