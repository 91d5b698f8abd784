"""Write expert records: one page-aligned record per (layer, expert), one file per layer.

BF16/FP16/FP32 experts are quantised to NVFP4 here; ModelOpt NVFP4 experts are copied byte for
byte. MTP layers continue the layer numbering after the decoder layers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from flashpack.layout.checkpoint_spec import iter_specs
from flashpack.convert.nvfp4 import quantize_nvfp4
from flashpack.convert.source import NVFP4Parts, SourceCheckpoint
from flashpack.layout.records import PROJECTIONS, RecordGeometry, encode_record, record_hash

EXPERT_DIR = "experts"


def expert_layers(checkpoint: SourceCheckpoint) -> list[int]:
    """Layers that hold routed experts, MTP layers included when the checkpoint has them."""
    return sorted({s.layer for s in iter_specs(checkpoint.config, with_mtp=checkpoint.has_mtp) if s.role == "expert"})


def expert_file(layer: int) -> str:
    return f"{EXPERT_DIR}/layer-{layer:03d}.bin"


def write_experts(checkpoint: SourceCheckpoint, pack: Path, progress: bool = True) -> list[dict]:
    """Write every layer's record file under `pack`; return the manifest's record entries."""
    cfg = checkpoint.config
    geometry = RecordGeometry(cfg.hidden_size, cfg.moe_intermediate_size)
    padding = bytes(geometry.stride - geometry.length)
    layers = expert_layers(checkpoint)
    (pack / EXPERT_DIR).mkdir(parents=True, exist_ok=True)
    entries = []
    bar = tqdm(total=len(layers) * cfg.num_experts, unit="expert", desc="experts", disable=not progress)
    for layer in layers:
        prefix = _layer_prefix(cfg.num_hidden_layers, layer)
        with open(pack / expert_file(layer), "wb") as handle:
            for expert in range(cfg.num_experts):
                parts = {p: _record_part(checkpoint, f"{prefix}mlp.experts.{expert}.{p}_proj.weight") for p in PROJECTIONS}
                record = encode_record(geometry, parts)
                entries.append({
                    "layer": layer, "expert": expert, "file": expert_file(layer),
                    "offset": handle.tell(), "length": len(record), "xxh64": record_hash(record),
                })
                handle.write(record)
                handle.write(padding)
                bar.update()
    bar.close()
    return entries


def _layer_prefix(num_hidden_layers: int, layer: int) -> str:
    if layer < num_hidden_layers:
        return f"layers.{layer}."
    return f"mtp.layers.{layer - num_hidden_layers}."


def _record_part(checkpoint: SourceCheckpoint, name: str) -> tuple[bytes, bytes, float]:
    """(nibbles, block scales, global scale) of one projection."""
    source = checkpoint.expert_parts(name)
    if isinstance(source, NVFP4Parts):
        packed, scales, global_scale = source.packed, source.block_scale, source.global_scale
    else:
        quantized = quantize_nvfp4(source)
        packed, scales, global_scale = quantized.packed, quantized.block_scale, float(quantized.global_scale)
    return _bytes(packed), _bytes(scales.view(torch.uint8)), global_scale


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().numpy().tobytes()
