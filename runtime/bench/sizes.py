"""Byte sizes a bench needs, from the manifest alone: dense weights inside and outside the decoder
layers (in the engine's dtype, as the engine holds them), what one forward reads outside the layers,
and the expert records.

"Fixed" is everything that does not grow with the layer count: dense tensors whose names do not
start with `layers.` (embed_tokens, lm_head, the final mixer, mtp.*) plus the store's one-fetch work
buffer and, on a GPU, its staging rows (STAGING_ROW_SETS * top_k records: the engine's store sets
them aside there, runtime/engine/build.py); `device_fixed` is what the store's `resident_device_bytes` counts minus the
layers' dense tensors, plus those rows, so budget scaling and the store's budget check agree.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from flashpack.layout.manifest import Manifest
from flashpack.runtime.store.budget import STAGING_ROW_SETS
from flashpack.runtime.store.build import dense_device_bytes, resident_device_bytes


@dataclass(frozen=True)
class ModelSizes:
    layers: int  # decoder layers in the pack (MTP not counted)
    width: int  # bytes per element of the engine dtype
    layer_dense_each: tuple[int, ...]  # dense tensors of each decoder layer (`layers.{i}.*`), engine dtype
    device_fixed: int  # device bytes that do not scale with layers (non-layer dense, work buffer, staging)
    head_read: int  # what a forward reads outside the layers: lm_head (or tied embedding) + final mixer
    embed_row: int  # one embedding row (read per token)
    record_bytes: int  # one expert record's data (what the compute reads)
    record_stride: int  # one record's slot (what the store moves)
    top_k: int

    @property
    def layer_dense(self) -> int:
        """Dense tensors of every decoder layer."""
        return sum(self.layer_dense_each)

    @property
    def per_forward_read(self) -> int:
        """Dense bytes one forward reads whatever its token count: every layer's + the head."""
        return self.layer_dense + self.head_read

    def to_dict(self) -> dict:
        return asdict(self) | {"layer_dense": self.layer_dense}


def model_sizes(manifest: Manifest, dtype: torch.dtype, device: torch.device | str = "cpu") -> ModelSizes:
    width = torch.empty((), dtype=dtype).element_size()
    tensors = manifest.dense_tensors()
    on_device = dense_device_bytes(manifest, width)
    names = list(on_device)
    cfg = manifest.config
    layer_dense_each = tuple(sum(on_device[n] for n in names if n.startswith(f"layers.{i}."))
                             for i in range(cfg.num_hidden_layers))
    layer_dense = sum(layer_dense_each)
    head = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head_read = on_device[head] + sum(on_device[n] for n in names if n.startswith("hyper_connection_mixer."))
    experts = manifest.document["experts"]
    staging = STAGING_ROW_SETS * cfg.num_experts_per_tok * experts["record_stride"]
    staging = staging if torch.device(device).type == "cuda" else 0
    return ModelSizes(
        layers=cfg.num_hidden_layers,
        width=width,
        layer_dense_each=layer_dense_each,
        device_fixed=resident_device_bytes(manifest, dtype, 0, device) - layer_dense + staging,
        head_read=head_read,
        embed_row=tensors["embed_tokens.weight"].shape[-1] * width,
        record_bytes=experts["record_bytes"],
        record_stride=experts["record_stride"],
        top_k=cfg.num_experts_per_tok,
    )


def baseline_fixed_bytes(manifest: Manifest, dtype: torch.dtype) -> int:
    """What transformers' model holds outside its decoder layers (no MTP there): embed_tokens,
    lm_head unless tied, the final mixer; at `dtype`."""
    width = torch.empty((), dtype=dtype).element_size()
    tensors = manifest.dense_tensors()
    scales = {t.row_scale for t in tensors.values() if t.row_scale}
    return sum(
        math.prod(t.shape) * width for name, t in tensors.items()
        if name not in scales and not name.startswith(("layers.", "mtp."))
    )
