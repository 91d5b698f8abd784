"""The keyword functions behind `flashpack profile` and `flashpack trace record|replay`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashpack.errors import FlashpackError
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.workload import run_workload
from flashpack.runtime.store.hotset import hot_set_from_trace, reorder_pack, save_hot_set
from flashpack.runtime.store.simulate import replay_trace
from flashpack.runtime.store.trace import Trace

__all__ = ["profile_pack", "record_trace", "replay_trace"]


def profile_pack(
    pack_path: Path | str, workload_path: Path | str, name: str, config: EngineConfig = EngineConfig(), *,
    reorder: bool = False, max_tokens: int = 32, trace_out: Path | str | None = None,
) -> dict[str, Any]:
    """Run the workload, rank each layer's experts, write hot_sets[name] into the manifest;
    with `reorder`, rewrite the record files so each layer's hot experts are contiguous.
    Returns the profile (plus "moved": records moved per layer when reordered)."""
    if not name or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise FlashpackError(f"hot set name {name!r}: use letters, digits, '-', '_' or '.'")
    trace = run_workload(pack_path, workload_path, config, max_tokens=max_tokens)
    if trace_out is not None:
        trace.save(trace_out)
    profile = hot_set_from_trace(trace, trace.meta.get("workload"))
    save_hot_set(pack_path, name, profile)
    if reorder:
        moved = reorder_pack(pack_path, name)
        profile = {**profile, "reordered": True}
        return {**profile, "moved": moved}
    return profile


def record_trace(
    pack_path: Path | str, workload_path: Path | str, out: Path | str, config: EngineConfig = EngineConfig(), *,
    max_tokens: int = 32,
) -> Trace:
    """Run the workload and write its routing trace to `out`."""
    trace = run_workload(pack_path, workload_path, config, max_tokens=max_tokens)
    trace.save(out)
    return trace

