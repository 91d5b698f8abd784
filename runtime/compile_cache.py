"""Where compiled kernels are kept between processes: one cache folder for flashpack's runs.

A fresh process on a GPU builds its Triton kernels (prompt path, decode kernels, flash-linear-
attention's, with their autotuning) and TorchInductor's fused decode pieces before it answers
quickly: on the H200 machine a first start spent ~90 s doing so for a 4-layer pack, a start that
found the caches ~10 s (bench/startup.sh). Triton keeps its cache in ~/.triton by default, but
TorchInductor in /tmp, which a reboot empties. So, unless the user set them, both caches go under
one folder that outlives a reboot (flash-linear-attention keeps its autotuning results in Triton's):
$FLASHPACK_CACHE_DIR, else $XDG_CACHE_HOME/flashpack, else ~/.cache/flashpack.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    chosen = os.environ.get("FLASHPACK_CACHE_DIR")
    if chosen:
        return Path(chosen).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "flashpack"


def use_persistent_compile_caches() -> dict[str, str]:
    """Point Triton's and TorchInductor's caches at `cache_root()` where the environment names
    none; call before the first kernel is built. Returns the settings in force."""
    root = cache_root()
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    return {name: os.environ[name] for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
