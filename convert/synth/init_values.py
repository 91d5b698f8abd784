"""Deterministic random values for every synthetic tensor, produced in bounded row blocks.

Each block is drawn from its own generator seeded by (seed, canonical name, block index), so a
tensor's values do not depend on write order, shard layout, checkpoint form (`qwen4_exp` or text
only), format (NVFP4 quantises these same values) or a `--layers` cut (kept layers are identical).

Scales are chosen so a random model runs sanely at any size, not to imitate trained statistics:
  * linears: normal(0, 1/sqrt(fan_in)), so activations keep unit scale whatever the width (a fixed
    0.02 would leave a 64-wide model's blocks doing almost nothing). Residual writers (o_proj,
    out_proj, down_proj) are further scaled by sqrt(8 / depth) so depth does not inflate the residual.
  * embeddings and PLE rows: normal(0, 1); lm_head has gain 4 so logits have a std near 2.
  * zero-centred RMSNorm weights (used as x * (1 + w)): normal(0, 0.05), so a w-vs-(1+w) bug shows;
    the DeltaNet gated norm (used as x * w): normal(1, 0.05).
  * DeltaNet: A_log = log(uniform(0.01, 16)), dt_bias normal(1, 0.1), conv kernels uniform(+-1/sqrt(k)).
  * PLE buffers: exactly what transformers computes from the config.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from flashpack.layout.checkpoint_spec import TensorSpec
from flashpack.convert.synth.vision import VisionTensor
from flashpack.layout.model_config import TextConfig

BLOCK_ELEMENTS = 1 << 20  # 4 MB of float32 per block bounds memory for the 1.3 GB embedding
EMBED_STD = 1.0
PLE_STD = 1.0
LOGIT_GAIN = 4.0
NORM_STD = 0.05
VISION_STD = 0.02
REFERENCE_DEPTH = 8
WRITER_SUFFIXES = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
_WORKERS = min(4, os.cpu_count() or 1)
_PARALLEL_MIN_BLOCKS = 8


class BlockAdjuster(Protocol):
    """Edits a float32 block of rows [row_start, row_start + len) of canonical tensor `name`."""

    def adjust(self, name: str, row_start: int, block: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Distribution:
    kind: Literal["normal", "uniform", "log_uniform"]
    a: float  # mean, or lower bound
    b: float  # std, or upper bound

    def sample(self, out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Fills float32 `out` in place and returns it."""
        if self.kind == "normal":
            return out.normal_(self.a, self.b, generator=generator)
        values = out.uniform_(self.a, self.b, generator=generator)
        return values.log_() if self.kind == "log_uniform" else values


def block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def text_distribution(name: str, shape: tuple[int, ...], nominal_layers: int) -> Distribution:
    if name == "embed_tokens.weight":
        return Distribution("normal", 0.0, EMBED_STD)
    if "ngram_embedding.shard_" in name:
        return Distribution("normal", 0.0, PLE_STD)
    if name.endswith("A_log"):
        return Distribution("log_uniform", 0.01, 16.0)
    if name.endswith("dt_bias"):
        return Distribution("normal", 1.0, 0.1)
    if name.endswith("conv1d.weight"):
        bound = 1 / math.sqrt(shape[-1])  # depthwise: fan-in is the kernel
        return Distribution("uniform", -bound, bound)
    if name.endswith("linear_attn.norm.weight"):
        return Distribution("normal", 1.0, NORM_STD)
    if len(shape) == 1:
        return Distribution("normal", 0.0, NORM_STD)  # every other 1-D weight is a (1 + w) RMSNorm
    gain = LOGIT_GAIN if name == "lm_head.weight" else 1.0
    if name.endswith(WRITER_SUFFIXES):
        gain *= math.sqrt(min(1.0, REFERENCE_DEPTH / nominal_layers))
    return Distribution("normal", 0.0, gain / math.sqrt(shape[1]))


def vision_distribution(tensor: VisionTensor) -> Distribution:
    if tensor.kind == "norm_weight":
        return Distribution("normal", 1.0, NORM_STD)
    return Distribution("normal", 0.0, VISION_STD)


class ValueSource:
    """Produces the values of one synthetic snapshot, block by block."""

    def __init__(self, cfg: TextConfig, seed: int, nominal_layers: int, adjuster: BlockAdjuster | None = None):
        self.cfg = cfg
        self.seed = seed
        self.nominal_layers = nominal_layers
        self.adjuster = adjuster
        self._scratch = threading.local()

    def text_blocks(self, spec: TensorSpec) -> Iterator[torch.Tensor]:
        """bf16 row blocks of `spec` (int64, whole, for PLE buffers)."""
        if spec.role == "ple_buffer":
            yield self._ple_buffer(spec)
            return
        yield from self._text_blocks(spec, lambda _, block: block.to(torch.bfloat16))

    def text_into(self, spec: TensorSpec, out: torch.Tensor) -> torch.Tensor:
        """Writes `spec`'s values into bf16 `out` (of its shape) and returns `out`: each block lands
        in place, without a bf16 copy of it or a concatenation."""
        for _ in self._text_blocks(spec, lambda row_start, block: out[row_start : row_start + len(block)].copy_(block)):
            pass
        return out

    def _text_blocks(
        self, spec: TensorSpec, store: Callable[[int, torch.Tensor], torch.Tensor]
    ) -> Iterator[torch.Tensor]:
        adjuster = self.adjuster

        def finish(row_start: int, block: torch.Tensor) -> torch.Tensor:
            if adjuster is not None:
                block = adjuster.adjust(spec.name, row_start, block)
            return store(row_start, block)

        distribution = text_distribution(spec.name, spec.shape, self.nominal_layers)
        yield from self._blocks(spec.name, spec.shape, distribution, finish)

    def vision_blocks(self, tensor: VisionTensor) -> Iterator[torch.Tensor]:
        yield from self._blocks(
            tensor.key, tensor.shape, vision_distribution(tensor), lambda _, b: b.to(torch.bfloat16)
        )

    def _blocks(
        self,
        name: str,
        shape: tuple[int, ...],
        distribution: Distribution,
        finish: Callable[[int, torch.Tensor], torch.Tensor],
    ) -> Iterator[torch.Tensor]:
        rows, row_elements = shape[0], math.prod(shape[1:])
        rows_per_block = max(1, BLOCK_ELEMENTS // max(row_elements, 1))
        starts = list(enumerate(range(0, rows, rows_per_block)))

        def make(index: int, row_start: int) -> torch.Tensor:
            generator = torch.Generator().manual_seed(block_seed(self.seed, name, index))
            buffer = self._draw_buffer((min(rows_per_block, rows - row_start), *shape[1:]))
            return finish(row_start, distribution.sample(buffer, generator))

        if len(starts) < _PARALLEL_MIN_BLOCKS:  # small tensors are parallel across tensors instead
            for index, row_start in starts:
                yield make(index, row_start)
            return
        # Sampling releases the GIL: a few blocks in flight use the cores while memory stays bounded.
        with ThreadPoolExecutor(max_workers=_WORKERS) as pool:
            pending: deque[Future[torch.Tensor]] = deque()
            for index, row_start in starts:
                pending.append(pool.submit(make, index, row_start))
                if len(pending) > _WORKERS:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

    def _draw_buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        """This thread's float32 buffer viewed as `shape`, reused for every block it draws: `finish`
        copies each block out (to bf16) before the next, and a fresh 4 MB block would be a fresh
        mmap (see shard_writer.pin_mmap_threshold), i.e. a page fault per 4 KB."""
        elements = math.prod(shape)
        buffer = getattr(self._scratch, "buffer", None)
        if buffer is None or buffer.numel() < elements:
            buffer = self._scratch.buffer = torch.empty(max(elements, BLOCK_ELEMENTS))
        return buffer[:elements].view(shape)

    def _ple_buffer(self, spec: TensorSpec) -> torch.Tensor:
        index = spec.ple_index
        if spec.name.endswith("layer_multipliers"):
            values = self.cfg.ple_multipliers(index)
        elif spec.name.endswith("ngram_heads_offsets"):
            values = self.cfg.ple_head_offsets(index)
        else:
            values = self.cfg.ple_head_vocab_sizes(index)
        return torch.tensor(values, dtype=torch.int64)
