"""Shared fixtures: tiny snapshots and packs built by the tests themselves (nothing downloaded).

On a machine without CUDA the Triton kernels run in Triton's interpreter. TRITON_INTERPRET has to
be set before triton itself is first imported, not only before our kernels are: triton.language's
own helpers (sigmoid, cdiv, ...) are jit functions, decorated at import, and torch imports triton
as soon as torch.compile's machinery loads (the engine's `torch.compiler.disable` marks do that).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The test models are tiny: extra intra-op threads only add contention on a 2-core CI box
    (a 5 us index_add_ took 60 ms under load with two threads); server worker threads share it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _heap_unfrozen():
    """An engine's warm-up freezes Python's heap (runtime/engine/collector.py), right for a server's
    one engine; in the suite's one process it would keep every earlier test's garbage cycles."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def tiny_snapshot(tmp_path_factory) -> Path:
    from flashpack.convert.synth import synthesize

    return synthesize("tiny", tmp_path_factory.mktemp("snap") / "tiny-bf16", format="bf16", seed=0)


@pytest.fixture(scope="session")
def tiny_nvfp4_snapshot(tmp_path_factory) -> Path:
    from flashpack.convert.synth import synthesize

    return synthesize("tiny", tmp_path_factory.mktemp("snap") / "tiny-nvfp4", format="nvfp4", seed=0)


@pytest.fixture(scope="session")
def tiny_pack(tiny_snapshot, tmp_path_factory) -> Path:
    from flashpack.convert.pipeline import convert

    return convert(str(tiny_snapshot), tmp_path_factory.mktemp("pack") / "tiny.pack", progress=False)


@pytest.fixture(scope="session")
def tiny_nvfp4_pack(tiny_nvfp4_snapshot, tmp_path_factory) -> Path:
    from flashpack.convert.pipeline import convert

    return convert(str(tiny_nvfp4_snapshot), tmp_path_factory.mktemp("pack") / "tiny-nvfp4.pack", progress=False)


@pytest.fixture(scope="session")
def demo_pack(tmp_path_factory) -> Path:
    """The committed demo model (demo_model/), converted."""
    from flashpack import demo_model
    from flashpack.convert.pipeline import convert

    return convert(str(demo_model.snapshot_path()), tmp_path_factory.mktemp("demo") / "demo.pack", progress=False)
