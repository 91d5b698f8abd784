"""The ModelOpt NVFP4 form: routed experts quantised, everything else BF16 and excluded by wildcard.

Per quantised linear a ModelOpt checkpoint holds `weight` (uint8 [out, in/2], element 2i in the low
nibble), `weight_scale` (float8_e4m3fn [out, in/16]), `weight_scale_2` (float32 scalar: the global
scale) and `input_scale` (float32 scalar: the calibrated activation amax / (6 * 448)). ModelOpt
gives an expert's gate and up projections one shared global scale (vLLM warns when they differ,
since it fuses them), so they are quantised as one [2 * inter, hidden] matrix and split again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flashpack.layout.checkpoint_spec import TensorSpec, expert_shapes
from flashpack.convert.nvfp4 import E2M1_MAX, quantize_nvfp4
from flashpack.layout.model_config import TextConfig
from flashpack.layout.nvfp4 import FP8_MAX, NVFP4_BLOCK, NVFP4Tensor

QUANT_ALGO = "NVFP4"
# Stand-ins for calibrated activation ranges (flashpack's W4A16 path does not use input_scale):
# the MoE input is normalised with one massive channel; the down projection sees SiLU(gate) * up.
_INPUT_AMAX = {"gate_proj": 32.0, "up_proj": 32.0, "down_proj": 8.0}
_QUANT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")
QuantizedExpert = dict[str, dict[str, torch.Tensor]]  # projection -> suffix -> tensor


@dataclass(frozen=True)
class QuantEntry:
    suffix: str  # replaces the spec name's trailing "weight"
    dtype: torch.dtype
    shape: tuple[int, ...]


def quantized_entries(spec: TensorSpec) -> list[QuantEntry]:
    """On-disk tensors replacing one expert projection's BF16 weight."""
    out_features, in_features = spec.shape
    return [
        QuantEntry("weight", torch.uint8, (out_features, in_features // 2)),
        QuantEntry("weight_scale", torch.float8_e4m3fn, (out_features, in_features // NVFP4_BLOCK)),
        QuantEntry("weight_scale_2", torch.float32, ()),
        QuantEntry("input_scale", torch.float32, ()),
    ]


def quantize_expert(gate_up: torch.Tensor, down: torch.Tensor) -> QuantizedExpert:
    """gate over up [2 * inter, hidden], down [hidden, inter] (float) -> {projection: {suffix: tensor}}
    in ModelOpt layout."""
    inter = gate_up.shape[0] // 2
    gate_up = quantize_nvfp4(gate_up)
    down = quantize_nvfp4(down)
    return modelopt_tensors({
        "gate_proj": NVFP4Tensor(gate_up.packed[:inter], gate_up.block_scale[:inter], gate_up.global_scale),
        "up_proj": NVFP4Tensor(gate_up.packed[inter:], gate_up.block_scale[inter:], gate_up.global_scale),
        "down_proj": down,
    })


def modelopt_tensors(parts: dict[str, NVFP4Tensor]) -> QuantizedExpert:
    """{projection: NVFP4Tensor} -> {projection: {suffix: tensor}} as a ModelOpt checkpoint stores them."""
    result = {}
    for projection, part in parts.items():
        packed, block_scale, global_scale = part.packed, part.block_scale, part.global_scale
        input_scale = torch.tensor(_INPUT_AMAX[projection] / (E2M1_MAX * FP8_MAX), dtype=torch.float32)
        result[projection] = {
            "weight": packed.contiguous(),
            "weight_scale": block_scale.contiguous(),
            "weight_scale_2": global_scale.reshape(()).float(),
            "input_scale": input_scale,
        }
    return result


def exclude_modules(cfg: TextConfig, text_prefix: str, with_vision: bool) -> list[str]:
    """ModelOpt-style wildcards (fnmatch) naming every module kept in BF16."""
    per_layer = (
        "linear_attn*",
        "self_attn*",
        "attn_hyper_connection*",
        "mlp_hyper_connection*",
        "mlp.gate",
        "mlp.shared_expert*",  # also matches shared_expert_gate
    )
    patterns = ["lm_head", f"{text_prefix}embed_tokens", f"{text_prefix}hyper_connection_mixer*"]
    patterns += [f"{text_prefix}layers.*.{module}" for module in per_layer]
    if cfg.ple_layer_ids:
        patterns.append(f"{text_prefix}layers.*.ple*")
    if cfg.mtp_num_hidden_layers:
        patterns += ["mtp.fc_embedding", "mtp.fc_hidden", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden"]
        patterns += [f"mtp.layers.*.{module}" for module in per_layer]
        patterns.append("mtp.hyper_connection_mixer*")
    if with_vision:
        patterns.append("model.visual*")
    return patterns


def quant_configs(excluded: list[str]) -> tuple[dict, dict]:
    """(hf_quant_config.json, config.json's quantization_config), as ModelOpt exports both."""
    hf_quant = {
        "producer": {"name": "modelopt", "version": "0.39.0"},
        "quantization": {
            "quant_algo": QUANT_ALGO,
            "group_size": NVFP4_BLOCK,
            "kv_cache_quant_algo": None,
            "exclude_modules": excluded,
        },
    }
    in_config = {
        "quant_method": "modelopt",
        "quant_algo": QUANT_ALGO,
        "group_size": NVFP4_BLOCK,
        "exclude_modules": excluded,
    }
    return hf_quant, in_config


def expert_key(spec: TensorSpec, suffix: str) -> str:
    """Canonical name of one quantised tensor: `...experts.7.up_proj.weight_scale` and so on."""
    assert spec.name.endswith(".weight") and suffix in _QUANT_SUFFIXES
    return spec.name[: -len("weight")] + suffix


def check_expert_shapes(cfg: TextConfig) -> None:
    for projection, (_, in_features) in expert_shapes(cfg).items():
        if in_features % NVFP4_BLOCK:
            raise ValueError(f"{projection} input width {in_features} is not a multiple of {NVFP4_BLOCK}")
