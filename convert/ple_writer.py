"""Write PLE row files: each n-gram table as FP8 e4m3 rows, each row followed by its float32 scale.

Rows are stored in runtime lookup order (the checkpoint's shards concatenated, as transformers'
loader does), so row r of the table is at byte r * row_stride and one token's 16 lookups are 16
small reads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from flashpack.layout.checkpoint_spec import iter_specs
from flashpack.convert.nvfp4 import quantize_fp8_rows
from flashpack.convert.source import SourceCheckpoint
from flashpack.errors import FlashpackError

PLE_DIR = "ple"
SCALE_BYTES = 4


def ple_row_bytes(rows: torch.Tensor) -> torch.Tensor:
    """float [n, dim] -> uint8 [n, dim + 4]: FP8 values then the little-endian float32 row scale."""
    values, scales = quantize_fp8_rows(rows)
    scale_bytes = scales.to(torch.float32).contiguous().view(torch.uint8).view(-1, SCALE_BYTES)
    return torch.cat([values.view(torch.uint8), scale_bytes], dim=1)


def write_ple(checkpoint: SourceCheckpoint, pack: Path, progress: bool = True) -> list[dict]:
    cfg = checkpoint.config
    tables = []
    specs = [s for s in iter_specs(cfg, with_mtp=False) if s.role == "ple"]
    if specs:
        (pack / PLE_DIR).mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(specs), unit="shard", desc="ple", disable=not progress)
    for ple_index, layer_id in enumerate(cfg.ple_layer_ids):
        layer = layer_id - 1
        _check_buffers(checkpoint, layer, ple_index)
        file = f"{PLE_DIR}/layer-{layer:03d}.bin"
        rows = 0
        with open(pack / file, "wb") as handle:
            for spec in (s for s in specs if s.ple_index == ple_index):
                for block in checkpoint.row_blocks(spec.name):
                    handle.write(ple_row_bytes(block).numpy())
                    rows += block.shape[0]
                bar.update()
        if rows != cfg.ple_table_rows(ple_index):
            raise FlashpackError(f"PLE table of layer {layer} has {rows} rows, the config implies {cfg.ple_table_rows(ple_index)}")
        tables.append({
            "layer": layer, "ple_index": ple_index, "file": file, "rows": rows, "dim": cfg.ple_head_dim,
            "row_stride": cfg.ple_head_dim + SCALE_BYTES,
            "head_vocab_sizes": cfg.ple_head_vocab_sizes(ple_index),
            "head_offsets": cfg.ple_head_offsets(ple_index),
            "multipliers": cfg.ple_multipliers(ple_index),
        })
    bar.close()
    return tables


def _check_buffers(checkpoint: SourceCheckpoint, layer: int, ple_index: int) -> None:
    """The checkpoint's hashing buffers must be the ones the config derives, or lookups go astray."""
    cfg = checkpoint.config
    prefix = f"layers.{layer}.ple.ple_embedding."
    expected = {
        "layer_multipliers": cfg.ple_multipliers(ple_index),
        "ngram_heads_offsets": cfg.ple_head_offsets(ple_index),
        "ngram_heads_vocab_sizes": cfg.ple_head_vocab_sizes(ple_index),
    }
    for name, values in expected.items():
        if checkpoint.has(prefix + name) and checkpoint.tensor(prefix + name).tolist() != values:
            raise FlashpackError(f"{prefix}{name} disagrees with the config's n-gram hashing parameters")
