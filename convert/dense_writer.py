"""Write the dense tensors (everything but routed experts and PLE tables) and the vision tower.

Dense tensors are stored in BF16 by default. With `fp8_rows`, the large projection matrices are
stored as float8_e4m3fn with a float32 scale per output row (`<name>.row_scale`), which halves
their resident size; embeddings, lm_head, routers, norms and hyper-connection weights stay BF16
because they are small or precision-critical.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from flashpack.layout.checkpoint_spec import iter_specs
from flashpack.convert.nvfp4 import quantize_fp8_rows
from flashpack.convert.safetensors_writer import StreamingSafetensorsWriter
from flashpack.convert.source import SourceCheckpoint

DENSE_FILE = "dense.safetensors"
VISION_FILE = "vision.safetensors"
ROW_SCALE_SUFFIX = ".row_scale"
FP8_ELIGIBLE_SUFFIXES = (
    "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.out_proj.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight",
    "ple.key_proj.weight", "ple.value_proj.weight", "mtp.fc_embedding.weight", "mtp.fc_hidden.weight",
)


def stored_as_fp8(name: str, fp8_rows: bool) -> bool:
    return fp8_rows and name.endswith(FP8_ELIGIBLE_SUFFIXES)


def write_dense(checkpoint: SourceCheckpoint, pack: Path, fp8_rows: bool, progress: bool = True) -> dict:
    specs = [s for s in iter_specs(checkpoint.config, with_mtp=checkpoint.has_mtp) if s.role == "dense"]
    declared: list[tuple[str, str, tuple[int, ...]]] = []
    for spec in specs:
        if stored_as_fp8(spec.name, fp8_rows):
            declared.append((spec.name, "F8_E4M3", spec.shape))
            declared.append((spec.name + ROW_SCALE_SUFFIX, "F32", spec.shape[:1]))
        else:
            declared.append((spec.name, "BF16", spec.shape))
    with StreamingSafetensorsWriter(pack / DENSE_FILE, declared, {"format": "pt"}) as writer:
        for spec in tqdm(specs, unit="tensor", desc="dense", disable=not progress):
            if stored_as_fp8(spec.name, fp8_rows):
                scales: list[torch.Tensor] = []
                writer.write_blocks(spec.name, _fp8_blocks(checkpoint, spec.name, scales))
                writer.write(spec.name + ROW_SCALE_SUFFIX, torch.cat(scales))
            else:
                writer.write_blocks(spec.name, (b.to(torch.bfloat16) for b in checkpoint.row_blocks(spec.name)))
        entries = _entries(writer, declared, fp8_rows)
    return {"file": DENSE_FILE, "fp8_rows": fp8_rows, "tensors": entries}


def _fp8_blocks(checkpoint: SourceCheckpoint, name: str, scales: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """FP8 values block by block; each block's row scales are appended to `scales`."""
    for block in checkpoint.row_blocks(name):
        values, block_scales = quantize_fp8_rows(block)
        scales.append(block_scales)
        yield values


def write_vision(checkpoint: SourceCheckpoint, pack: Path) -> dict | None:
    """Vision weights go aside, unchanged, so a text-only runtime never maps them."""
    keys = checkpoint.vision_keys()
    if not keys:
        return None
    declared = []
    for key in keys:
        stored = checkpoint.entries[key]
        declared.append((key, stored.dtype, stored.shape))
    with StreamingSafetensorsWriter(pack / VISION_FILE, declared, {"format": "pt"}) as writer:
        for key in keys:
            writer.write(key, checkpoint.raw(key))
        entries = _entries(writer, declared, fp8_rows=False)
    return {"file": VISION_FILE, "tensors": entries}


def _entries(writer: StreamingSafetensorsWriter, declared: list, fp8_rows: bool) -> list[dict]:
    entries = []
    names = {name for name, _, _ in declared}
    for name, dtype, shape in declared:
        offset, length = writer.offsets(name)
        entry = {"name": name, "dtype": dtype, "shape": list(shape), "offset": offset, "length": length}
        if dtype == "F8_E4M3" and name + ROW_SCALE_SUFFIX in names:
            entry["row_scale"] = name + ROW_SCALE_SUFFIX
        entries.append(entry)
    return entries

