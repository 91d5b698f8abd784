"""`flashpack bench`: what a pack's tokens cost on this machine, against the bandwidth ceilings and
against transformers + accelerate offload at the same memory budget.

    run_bench(pack, vram_budget=..., ram_budget=..., prompt_len=N, gen=M, ...) -> report dict

One concept per module: `bandwidth` (the machine's ceilings), `sizes` (bytes from the manifest),
`roofline` (bytes per tier / bandwidth), `emulate` (budgets and times scaled to a full layer
count), `workload` (the prompt), `phases` (store counters per phase), `run` (our engine timed),
`baseline` (transformers timed), `check` (both compute the same model), `machine`, `report`.
"""

from __future__ import annotations

__all__ = ["run_bench"]


def __getattr__(name: str):
    if name == "run_bench":
        from flashpack.runtime.bench.bench import run_bench

        return run_bench
    raise AttributeError(name)
