"""The vision tower's tensors, named as transformers' `Qwen4ExpVisionModel` names them.

flashpack runs text only, so a synthetic snapshot carries a small tower: enough for the multimodal
form to load in transformers with no missing keys and for the converter to see (and skip) real
`model.visual.*` names. Names and shapes follow the module tree of transformers 5.23
(patch_embed, pos_embed, blocks.{i}.{norm1,norm2,attn,mlp}, merger).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

VISION_PREFIX = "model.visual."
VisionKind = Literal["weight", "bias", "norm_weight", "norm_bias"]


@dataclass(frozen=True)
class VisionTensor:
    key: str  # on-disk key, e.g. "model.visual.blocks.0.attn.qkv.weight"
    shape: tuple[int, ...]
    kind: VisionKind


def iter_vision_tensors(vision: dict[str, Any]) -> Iterator[VisionTensor]:
    hidden, inter = int(vision["hidden_size"]), int(vision["intermediate_size"])
    patch, temporal = int(vision["patch_size"]), int(vision["temporal_patch_size"])
    merged = hidden * int(vision["spatial_merge_size"]) ** 2
    p = VISION_PREFIX
    yield VisionTensor(
        p + "patch_embed.proj.weight", (hidden, int(vision["in_channels"]), temporal, patch, patch), "weight"
    )
    yield VisionTensor(p + "patch_embed.proj.bias", (hidden,), "bias")
    yield VisionTensor(p + "pos_embed.weight", (int(vision["num_position_embeddings"]), hidden), "weight")
    for block in range(int(vision["depth"])):
        b = f"{p}blocks.{block}."
        for norm in ("norm1", "norm2"):
            yield VisionTensor(f"{b}{norm}.weight", (hidden,), "norm_weight")
            yield VisionTensor(f"{b}{norm}.bias", (hidden,), "norm_bias")
        yield from _linear(b + "attn.qkv", 3 * hidden, hidden)
        yield from _linear(b + "attn.proj", hidden, hidden)
        yield from _linear(b + "mlp.linear_fc1", inter, hidden)
        yield from _linear(b + "mlp.linear_fc2", hidden, inter)
    yield VisionTensor(p + "merger.norm.weight", (hidden,), "norm_weight")
    yield VisionTensor(p + "merger.norm.bias", (hidden,), "norm_bias")
    yield from _linear(p + "merger.linear_fc1", merged, merged)
    yield from _linear(p + "merger.linear_fc2", int(vision["out_hidden_size"]), merged)


def _linear(prefix: str, out_features: int, in_features: int) -> Iterator[VisionTensor]:
    yield VisionTensor(prefix + ".weight", (out_features, in_features), "weight")
    yield VisionTensor(prefix + ".bias", (out_features,), "bias")
