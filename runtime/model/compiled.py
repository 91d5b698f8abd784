"""The model's pieces compiled by torch.compile (Qwen4ExpModel's `compile_pieces`).

A module with `compile_pieces` set runs the plain tensor code between its kernels of their own (the
hyper-connection mixes and combines, the router and shared expert, DeltaNet's projections, conv and
output norm, attention's projections, norms and rotary) as module-level functions through
`piece(fn, True)`: compiled with the step length dynamic, their many small operations become a few
fused kernels, which is what a short prompt's layer needs (its pace is the host's launches, not the
GPU's work). Each function takes its module as an argument, so the module's weights are inputs of
one compiled graph for every module of a kind, not constants of a graph a module, and none reads a
layer's index: dynamo would compile it again for each. The plain functions are the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch


@cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)


def piece(fn: Callable, compile_: bool) -> Callable:
    """`fn` itself, or (compile_) its compiled form, one for the process."""
    return _compiled(fn) if compile_ else fn
