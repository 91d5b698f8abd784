"""What a pack should hold, derived from the source snapshot alone (never from the pack).

The reference model is fed these tensors, so it computes what a correct pack would compute; a pack
whose bytes went wrong anywhere disagrees with it. Each tensor goes through the same, documented
rounding the converter applies (FORMAT.md), independently re-done here from the snapshot:

    dense tensors   BF16 (F8_E4M3 rows with a float32 row scale for the eligible matrices when the
                    pack was converted with --dense-fp8)
    routed experts  NVFP4: the snapshot's own nibbles and scales for a ModelOpt NVFP4 source,
                    quantised with the standard recipe for a BF16 source, then dequantised
    PLE rows        F8_E4M3 with a float32 scale per row

Everything is returned as float32 on the CPU; the caller casts to its compute dtype and device.
"""

from __future__ import annotations

import torch

from flashpack.layout.checkpoint_spec import checkpoint_key, ple_shard_rows
from flashpack.convert.dense_writer import stored_as_fp8
from flashpack.convert.nvfp4 import quantize_fp8_rows, quantize_nvfp4
from flashpack.convert.source import NVFP4Parts, SourceCheckpoint
from flashpack.layout.model_config import TextConfig
from flashpack.layout.nvfp4 import dequantize_fp8_rows, dequantize_nvfp4
from flashpack.runtime.experts import ExpertWeights

PROJECTIONS = ("gate", "up", "down")


class ExpectedWeights:
    """Tensors of `snapshot` as the pack should store them, decoded back to float32."""

    def __init__(self, snapshot: SourceCheckpoint, dense_fp8_rows: bool):
        self.snapshot = snapshot
        self.config: TextConfig = snapshot.config
        self.dense_fp8_rows = dense_fp8_rows

    def dense(self, name: str) -> torch.Tensor:
        """Canonical dense tensor name -> float32 tensor after the pack's storage rounding."""
        tensor = self.snapshot.tensor(name)
        if stored_as_fp8(name, self.dense_fp8_rows):
            return dequantize_fp8_rows(*quantize_fp8_rows(tensor))
        return tensor.to(torch.bfloat16).float()

    def buffer(self, name: str) -> torch.Tensor:
        """A non-float checkpoint tensor (the PLE hashing buffers), unchanged."""
        return self.snapshot.tensor(name)

    def expert(self, layer: int, expert: int, device: torch.device | str = "cpu") -> ExpertWeights:
        """One routed expert of decoder `layer`, NVFP4-rounded: gate, up [I, H]; down [H, I], on `device`.

        Quantising (BF16 sources) runs on the CPU, where the converter ran it; decoding, exact in
        float32 on any device, runs on `device`."""
        prefix = f"layers.{layer}.mlp.experts.{expert}."
        return ExpertWeights(*(self._nvfp4(f"{prefix}{p}_proj.weight", device) for p in PROJECTIONS))

    def _nvfp4(self, name: str, device: torch.device | str) -> torch.Tensor:
        parts = self.snapshot.expert_parts(name)
        if isinstance(parts, NVFP4Parts):
            packed, scales, global_scale = parts.packed, parts.block_scale, parts.global_scale
        else:
            quantized = quantize_nvfp4(parts)
            # The record trailer holds the global scale as a float32: round-trip it the same way.
            packed, scales, global_scale = quantized.packed, quantized.block_scale, float(quantized.global_scale)
        return dequantize_nvfp4(packed.to(device), scales.to(device), global_scale)

    def ple_rows(self, ple_index: int, rows: torch.Tensor) -> torch.Tensor:
        """int64 [N] table row ids -> float32 [N, ple_head_dim], read row by row from the shards."""
        cfg = self.config
        layer = cfg.ple_layer_ids[ple_index] - 1
        total, parts = cfg.ple_table_rows(ple_index), cfg.split_ngram_parts
        per_shard = ple_shard_rows(total, parts, 0)
        picked = []
        for row in rows.tolist():
            if not 0 <= row < total:
                raise IndexError(f"PLE row {row} outside the table of layer {layer} ({total} rows)")
            shard, offset = divmod(row, per_shard)
            name = f"layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{shard}.weight"
            picked.append(self.snapshot.raw_rows(checkpoint_key(name, self.snapshot.form), offset, 1))
        if not picked:
            return torch.zeros(0, cfg.ple_head_dim)
        # quantize_fp8_rows works row by row, so rounding a subset equals rounding the whole table.
        return dequantize_fp8_rows(*quantize_fp8_rows(torch.cat(picked)))
