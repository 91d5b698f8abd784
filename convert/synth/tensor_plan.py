"""The synthetic checkpoint's on-disk tensors, in order, each with a lazy producer of its values.

Names, shapes and order come from `checkpoint_spec` (the single source of truth for checkpoint
naming) and `vision`; this module only maps them to on-disk keys of the chosen form and dtypes of
the chosen format. Nothing is computed until the shard writer asks for a tensor's blocks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future

import torch
from flashpack.convert.checkpoint_spec import TensorSpec, checkpoint_key, iter_specs
from flashpack.convert.synth.init_values import ValueSource
from flashpack.convert.synth.nvfp4_experts import (
    expert_key,
    quantize_expert,
    quantized_entries,
)
from flashpack.convert.synth.presets import SynthPlan
from flashpack.convert.synth.shard_writer import DiskTensor, release_free_memory
from flashpack.convert.synth.vision import iter_vision_tensors


class ExpertQuantizer:
    """Quantises one expert's three projections together, once, for its twelve on-disk tensors.

    The writer asks for them in order on its own thread (they are not prefetched, see
    shard_writer), so one cached expert suffices; the lock and future only make that safe if a
    caller does use threads.
    """

    _KEEP = 2

    def __init__(self, values: ValueSource, specs_by_expert: dict[tuple[int, int], list[TensorSpec]]):
        self._values = values
        self._specs = specs_by_expert
        self._lock = threading.Lock()
        self._experts: OrderedDict[tuple[int, int], Future] = OrderedDict()

    def tensor(self, spec: TensorSpec, suffix: str) -> torch.Tensor:
        key = (spec.layer, spec.expert)
        with self._lock:
            future = self._experts.get(key)
            owner = future is None
            if owner:
                future = self._experts[key] = Future()
                while len(self._experts) > self._KEEP:
                    self._experts.popitem(last=False)
        if owner:
            try:
                weights = {s.projection: self._values.text_tensor(s).float() for s in self._specs[key]}
                future.set_result(quantize_expert(weights))
                del weights
                release_free_memory()
            except BaseException as error:
                future.set_exception(error)
                raise
        return future.result()[spec.projection][suffix]


def disk_tensors(plan: SynthPlan, values: ValueSource) -> list[DiskTensor]:
    cfg, form = plan.cfg, plan.form
    specs = list(iter_specs(cfg, with_mtp=cfg.mtp_num_hidden_layers > 0))
    quantize = plan.options.format == "nvfp4"
    quantizer = None
    if quantize:
        by_expert: dict[tuple[int, int], list[TensorSpec]] = {}
        for spec in specs:
            if spec.role == "expert":
                by_expert.setdefault((spec.layer, spec.expert), []).append(spec)
        quantizer = ExpertQuantizer(values, by_expert)

    tensors: list[DiskTensor] = []
    for spec in specs:
        if quantizer is not None and spec.role == "expert":
            for entry in quantized_entries(spec):
                tensors.append(
                    DiskTensor(
                        checkpoint_key(expert_key(spec, entry.suffix), form),
                        entry.dtype,
                        entry.shape,
                        _one(quantizer, spec, entry.suffix),
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


def _one(quantizer: ExpertQuantizer, spec: TensorSpec, suffix: str):
    def produce() -> Iterator[torch.Tensor]:
        yield quantizer.tensor(spec, suffix)

    return produce
