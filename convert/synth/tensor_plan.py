"""The synthetic checkpoint's on-disk tensors, in order, each with a lazy producer of its values.

Names, shapes and order come from `checkpoint_spec` (the single source of truth for checkpoint
naming) and `vision`; this module only maps them to on-disk keys of the chosen form and dtypes of
the chosen format. Nothing is computed until the shard writer asks for a tensor's blocks.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch
from flashpack.convert.synth.fast_experts import FastExperts
from flashpack.convert.synth.init_values import ValueSource
from flashpack.convert.synth.nvfp4_experts import (
    QuantizedExpert,
    expert_key,
    quantize_expert,
    quantized_entries,
)
from flashpack.convert.synth.presets import SynthPlan
from flashpack.convert.synth.shard_writer import DiskTensor
from flashpack.convert.synth.vision import iter_vision_tensors
from flashpack.layout.checkpoint_spec import EXPERT_PROJECTIONS, TensorSpec, checkpoint_key, iter_specs

_WORKERS = min(16, os.cpu_count() or 1)
_WINDOW = 2 * _WORKERS  # experts made ahead of the writer: about 3 MB each at real dims
ExpertKey = tuple[int, int]  # (layer, expert)
MakeExpert = Callable[[list[TensorSpec], threading.local], QuantizedExpert]  # may run on any thread


class ExpertStream:
    """Makes one expert's three projections together, once, for its twelve on-disk tensors.

    Making an expert (sampling and NVFP4 rounding, or drawing blocks) costs far more than writing
    it, so the experts after the one the writer asks for are made a bounded window ahead on worker
    threads; an expert is dropped once the writer moves on. The writer must ask for experts in
    checkpoint order, from one thread.
    """

    def __init__(self, make: MakeExpert, specs_by_expert: dict[ExpertKey, list[TensorSpec]]):
        self._in_order = _made_in_order(make, specs_by_expert)
        self._current: tuple[ExpertKey, QuantizedExpert] | None = None

    def tensor(self, spec: TensorSpec, suffix: str) -> torch.Tensor:
        key = (spec.layer, spec.expert)
        while self._current is None or self._current[0] != key:
            self._current = next(self._in_order, None)
            if self._current is None:
                raise ValueError(f"expert {key} asked for out of checkpoint order")
        return self._current[1][spec.projection][suffix]


def _made_in_order(
    make: MakeExpert, specs_by_expert: dict[ExpertKey, list[TensorSpec]]
) -> Iterator[tuple[ExpertKey, QuantizedExpert]]:
    pool = ThreadPoolExecutor(max_workers=_WORKERS)
    scratch = threading.local()  # each worker's buffers, reused from expert to expert
    pending: deque[tuple[ExpertKey, Future[QuantizedExpert]]] = deque()
    try:
        for key, specs in specs_by_expert.items():
            pending.append((key, pool.submit(make, specs, scratch)))
            if len(pending) > _WINDOW:
                done, future = pending.popleft()
                yield done, future.result()
    except BaseException:  # GeneratorExit too: a write that stops early drops the queued experts
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=False)  # the threads finish the queued experts, then exit
    while pending:
        done, future = pending.popleft()
        yield done, future.result()


def sampled_expert(values: ValueSource, specs: list[TensorSpec], scratch: threading.local) -> QuantizedExpert:
    """The expert's BF16 values, sampled as the BF16 snapshot holds them, quantised."""
    by_projection = {spec.projection: spec for spec in specs}
    gate, up, down = (by_projection[projection] for projection in EXPERT_PROJECTIONS)
    inter = gate.shape[0]
    gate_up, down_values = _input_buffers(scratch, ((2 * inter, gate.shape[1]), down.shape))
    values.text_into(gate, gate_up[:inter])
    values.text_into(up, gate_up[inter:])
    return quantize_expert(gate_up, values.text_into(down, down_values))


def _input_buffers(scratch: threading.local, shapes: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, ...]:
    """This thread's bf16 buffers of these shapes, reused from expert to expert: the quantised
    result keeps nothing of its input, and fresh ones would be fresh mmaps, a page fault per 4 KB
    (see shard_writer.pin_mmap_threshold)."""
    buffers = getattr(scratch, "inputs", ())
    if tuple(buffer.shape for buffer in buffers) != shapes:
        buffers = scratch.inputs = tuple(torch.empty(shape, dtype=torch.bfloat16) for shape in shapes)
    return buffers


def disk_tensors(plan: SynthPlan, values: ValueSource) -> list[DiskTensor]:
    cfg, form = plan.cfg, plan.form
    specs = list(iter_specs(cfg, with_mtp=cfg.mtp_num_hidden_layers > 0))
    stream = None
    if plan.options.format == "nvfp4":
        by_expert: dict[ExpertKey, list[TensorSpec]] = {}
        for spec in specs:
            if spec.role == "expert":
                by_expert.setdefault((spec.layer, spec.expert), []).append(spec)
        if plan.options.fast_experts:
            make: MakeExpert = FastExperts(values, by_expert.values()).expert
        else:
            make = partial(sampled_expert, values)
        stream = ExpertStream(make, by_expert)

    tensors: list[DiskTensor] = []
    for spec in specs:
        if stream is not None and spec.role == "expert":
            for entry in quantized_entries(spec):
                tensors.append(
                    DiskTensor(
                        checkpoint_key(expert_key(spec, entry.suffix), form),
                        entry.dtype,
                        entry.shape,
                        _one(stream, spec, entry.suffix),
                        prefetch=False,
                    )
                )
            continue
        dtype = torch.int64 if spec.role == "ple_buffer" else torch.bfloat16
        tensors.append(DiskTensor(checkpoint_key(spec.name, form), dtype, spec.shape, _text_blocks(values, spec)))
    if plan.vision_config is not None:
        for vision_tensor in iter_vision_tensors(plan.vision_config):
            tensors.append(
                DiskTensor(
                    vision_tensor.key,
                    torch.bfloat16,
                    vision_tensor.shape,
                    lambda t=vision_tensor: values.vision_blocks(t),
                )
            )
    return tensors


def _text_blocks(values: ValueSource, spec: TensorSpec):
    return lambda: values.text_blocks(spec)


def _one(stream: ExpertStream, spec: TensorSpec, suffix: str):
    def produce() -> Iterator[torch.Tensor]:
        yield stream.tensor(spec, suffix)

    return produce
