"""The baseline: transformers' own qwen4_exp model (`Qwen4ExpForCausalLM`) with accelerate offload at
the same memory budget, fed the pack's weights, timed like our engine.

What `from_pretrained(..., device_map="auto", max_memory=...)` would do, built from the pack:

    1. the model with K decoder layers on the meta device (accelerate's init_empty_weights;
       buffers such as the rotary table and the n-gram hash constants are computed for real)
    2. each PLE layer's n-gram table (the real one is ~95 GiB, which transformers itself keeps out
       of the device map through `_no_placement_params`) is swapped for a lookup of the rows the
       tokens hash to, from the pack's FP8 rows: the same values our engine reads
    3. a device map from transformers' `infer_auto_device_map` (decoder layers unsplit) under
       max_memory = {device: VRAM budget, "cpu": RAM budget} (on a CPU: {"cpu": VRAM + RAM}); what
       fits neither goes to "disk"
    4. every parameter filled from the pack, layer by layer (experts dequantised from their NVFP4
       records, dense tensors as stored; all in the run's dtype), straight to its device, or
       written to an offload folder beside the pack when the map says "disk"
    5. accelerate's `dispatch_model`: the hooks that move offloaded weights to the device for
       every forward, which is what the baseline pays for

Then the same prompt (cut to `prompt_len`) is prefilled and `gen` tokens decoded greedily with a
DynamicCache, every clock read after a device synchronize. Forward hooks on the decoder layers
time them (weights moving in included), so the per-layer time can be scaled to other layer counts.
Attention and experts run in transformers' default implementations for the device (recorded).
"""

from __future__ import annotations

import gc
import importlib.util
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from flashpack.errors import FlashpackError
from flashpack.layout.pack import Pack
from flashpack.runtime.bench.clock import synchronize
from flashpack.runtime.pack_source import PackWeights

BASELINES = ("transformers",)
EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass
class BaselineResult:
    layers: int
    prompt_tokens: int
    gen_tokens: int
    ttft_s: float
    decode_seconds: float
    layer_seconds: dict[str, float]  # summed over the decoder layers: "prefill", "decode" (whole phase)
    generated: list[int]
    placement: dict
    build_seconds: float
    implementations: dict
    first_logits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def fixed_seconds(self) -> dict[str, float]:
        """Time outside the decoder layers (embedding, final mixer, lm_head, weights they pull in):
        prefill, and per decode token."""
        return {
            "prefill": max(self.ttft_s - self.layer_seconds["prefill"], 0.0),
            "decode": max(self.decode_seconds - self.layer_seconds["decode"], 0.0) / self.gen_tokens,
        }

    def to_dict(self) -> dict:
        return {
            "engine": "transformers + accelerate",
            "layers": self.layers,
            "prefill": {"tokens": self.prompt_tokens, "ttft_s": self.ttft_s,
                        "tokens_per_s": self.prompt_tokens / self.ttft_s},
            "decode": {"tokens": self.gen_tokens, "seconds": self.decode_seconds,
                       "tokens_per_s": self.gen_tokens / self.decode_seconds,
                       "ms_per_token": 1000 * self.decode_seconds / self.gen_tokens},
            "layer_seconds": self.layer_seconds,
            "fixed_seconds": self.fixed_seconds,
            "generated": self.generated,
            "placement": self.placement,
            "build_seconds": self.build_seconds,
            "implementations": self.implementations,
        }


class _PackRows(nn.Module):
    """Stands in for a PLE layer's `ngram_embedding`: the looked-up rows, read from the pack.

    `weight` is a plain attribute (no parameter, no buffer), so the table stays out of accelerate's
    device map; transformers reads only its `.device` (meta: no placement)."""

    def __init__(self, weights: PackWeights, ple_index: int, dtype: torch.dtype):
        super().__init__()
        self.weights, self.ple_index, self.dtype = weights, ple_index, dtype
        self.weight = torch.empty(0, device="meta")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        rows = self.weights.ple_rows(self.ple_index, unique.cpu()).to(device=ids.device, dtype=self.dtype)
        return rows[inverse].reshape(*ids.shape, -1)


def baseline_config(raw_text_config: dict, layers: int):
    """transformers' text config of the pack's model cut to its first `layers` decoder layers."""
    from transformers import Qwen4ExpTextConfig

    raw = dict(raw_text_config)
    raw["num_hidden_layers"] = layers
    if "layer_types" in raw:
        raw["layer_types"] = list(raw["layer_types"])[:layers]
    return Qwen4ExpTextConfig.from_dict(raw)


def max_memory_for(device: torch.device, vram: int | None, ram: int | None) -> dict | None:
    """accelerate's max_memory for the budgets (None: no budget, everything on the device)."""
    if vram is None and ram is None:
        return None
    if device.type == "cuda":
        return {device.index or 0: vram if vram is not None else torch.cuda.get_device_properties(device).total_memory,
                "cpu": ram if ram is not None else 0}
    return {"cpu": (vram or 0) + (ram or 0)}


class TransformersBaseline:
    """Builds, places and times the transformers model; `close()` frees it and its offload folder."""

    def __init__(self, pack: Pack, layers: int, dtype: torch.dtype, device: torch.device,
                 max_memory: dict | None, offload_root: Path | None = None, progress: bool = False):
        cfg = pack.manifest.config
        if not 1 <= layers <= cfg.num_hidden_layers:
            raise FlashpackError(f"--baseline-layers must be 1..{cfg.num_hidden_layers} (the pack's layers), got {layers}")
        self.pack, self.layers, self.dtype, self.device = pack, layers, dtype, device
        self.weights = PackWeights(pack)
        self.progress = progress
        self._offload = tempfile.TemporaryDirectory(prefix=".flashpack-bench-offload-",
                                                    dir=offload_root or pack.root.parent)
        start = time.perf_counter()
        self.model = self._build(max_memory)
        self._has_attention = any(kind != "linear_attention" for kind in self.model.config.layer_types[:layers])
        self.build_seconds = time.perf_counter() - start

    # ---- building ---------------------------------------------------------------------------

    def _build(self, max_memory: dict | None):
        from accelerate import dispatch_model, init_empty_weights
        from accelerate.utils import (
            offload_weight,
            save_offload_index,
            set_module_tensor_to_device,
        )
        from transformers import Qwen4ExpForCausalLM
        from transformers.integrations.accelerate import (
            expand_device_map,
            infer_auto_device_map,
        )

        config = baseline_config(self.pack.manifest.config.raw, self.layers)
        with init_empty_weights(include_buffers=False):
            model = Qwen4ExpForCausalLM(config)
        model.eval().requires_grad_(False)
        for module in model.modules():  # meta parameters take the run's dtype (sizes for the map)
            for name, param in list(module._parameters.items()):
                if param is not None and param.is_floating_point():
                    module._parameters[name] = nn.Parameter(param.to(self.dtype), requires_grad=False)
        for index, layer in enumerate(model.model.layers):
            if layer.ple is not None:
                ple_index = self.pack.manifest.config.ple_index(index)
                layer.ple.ple_embedding.ngram_embedding = _PackRows(self.weights, ple_index, self.dtype)
        main = (self.device.index or 0) if self.device.type == "cuda" else "cpu"
        if max_memory is None:
            device_map = {"": main}
        else:
            device_map = dict(infer_auto_device_map(model, max_memory=max_memory,
                                                    no_split_module_classes=model._no_split_modules))
        names = [name for name, _ in model.named_parameters()]
        where = expand_device_map(device_map, names)
        offload_index: dict = {}
        placed = {"device": 0, "cpu": 0, "disk": 0}
        for name in tqdm(names, desc="baseline weights", unit="tensor", disable=not self.progress, leave=False):
            value = self._tensor(name)
            target = where[name]
            if target == "disk":
                offload_index = offload_weight(value, name, self._offload.name, offload_index)
            else:
                set_module_tensor_to_device(model, name, target, value=value)
            # "device": the run's device (RAM itself on a CPU run); "cpu": offloaded to RAM from a GPU
            offloaded = target == "cpu" and self.device.type == "cuda"
            placed["disk" if target == "disk" else "cpu" if offloaded else "device"] += value.nbytes
            del value
        gc.collect()
        disk = bool(offload_index)
        if disk:
            save_offload_index(offload_index, self._offload.name)
        dispatch_model(model, device_map, main_device=main, offload_dir=self._offload.name if disk else None,
                       offload_index=offload_index or None, skip_keys=model._skip_keys_device_placement)
        self.placement = {"bytes": placed, "device_map": {k: str(v) for k, v in device_map.items()},
                          "max_memory": {str(k): v for k, v in max_memory.items()} if max_memory else None}
        self.implementations = {
            "attention": model.config._attn_implementation,
            "experts": getattr(model.config, "_experts_implementation", None),
            "fla_kernels": importlib.util.find_spec("fla") is not None,
            "causal_conv1d": importlib.util.find_spec("causal_conv1d") is not None,
        }
        return model

    def _tensor(self, name: str) -> torch.Tensor:
        """Parameter `name` of the transformers model, from the pack, in the run's dtype (CPU)."""
        canonical = name.removeprefix("model.")
        for suffix in EXPERT_PARAMS:
            if canonical.endswith(suffix):
                return self._experts(int(canonical.split(".")[1]), suffix)
        return self.weights.dense(canonical).to(self.dtype)

    def _experts(self, layer: int, which: str) -> torch.Tensor:
        """gate_up_proj [E, 2I, H] (gate rows, then up) or down_proj [E, H, I], dequantised."""
        cfg = self.pack.manifest.config
        experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        gate_up = which.endswith("gate_up_proj")
        out = torch.empty((experts, 2 * inter, hidden) if gate_up else (experts, hidden, inter), dtype=self.dtype)
        for expert in range(experts):
            decoded = self.pack.expert(layer, expert)
            if gate_up:
                out[expert, :inter] = decoded.dequantize("gate")
                out[expert, inter:] = decoded.dequantize("up")
            else:
                out[expert] = decoded.dequantize("down")
        return out

    # ---- running ----------------------------------------------------------------------------

    @property
    def execution_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    @torch.inference_mode()
    def run(self, prompt: list[int], gen: int) -> BaselineResult:
        from transformers import DynamicCache

        model, device = self.model, self.execution_device
        layer_time = {"seconds": 0.0, "start": 0.0}

        def before(_module, _args):
            synchronize(device)
            layer_time["start"] = time.perf_counter()

        def after(_module, _args, _out):
            synchronize(device)
            layer_time["seconds"] += time.perf_counter() - layer_time["start"]

        hooks = [h for layer in model.model.layers
                 for h in (layer.register_forward_pre_hook(before), layer.register_forward_hook(after))]
        try:
            self._forward(DynamicCache(config=model.config), prompt[: min(len(prompt), 4)], 0)  # warm-up
            layer_time["seconds"] = 0.0
            cache = DynamicCache(config=model.config)
            synchronize(device)
            start = time.perf_counter()
            logits = self._forward(cache, prompt, 0)
            token = int(logits.argmax())
            synchronize(device)
            ttft = time.perf_counter() - start
            prefill_layers, layer_time["seconds"] = layer_time["seconds"], 0.0
            generated, position, decode = [token], len(prompt), 0.0
            for _ in tqdm(range(gen), desc="baseline decode", unit="tok", disable=not self.progress, leave=False):
                start = time.perf_counter()
                token = int(self._forward(cache, [token], position).argmax())
                synchronize(device)
                decode += time.perf_counter() - start
                generated.append(token)
                position += 1
        finally:
            for hook in hooks:
                hook.remove()
        return BaselineResult(
            layers=self.layers, prompt_tokens=len(prompt), gen_tokens=gen, ttft_s=ttft, decode_seconds=decode,
            layer_seconds={"prefill": prefill_layers, "decode": layer_time["seconds"]}, generated=generated,
            placement=self.placement, build_seconds=self.build_seconds, implementations=self.implementations,
            first_logits=logits.float().cpu(),
        )

    def _forward(self, cache, ids: list[int], start: int) -> torch.Tensor:
        """Logits of the last of `ids` (at positions start..), the cache advanced."""
        device = self.execution_device
        # positions are given: transformers' cache cannot count them without an attention layer
        positions = torch.arange(start, start + len(ids), device=device)[None]
        # Without an attention layer transformers cannot build its causal mask from the cache (it
        # asks an attention layer for the sequence length); no padding means no mask is needed.
        masks = None if self._has_attention else {"indexed_attention": None, "linear_attention": None}
        out = self.model(input_ids=torch.tensor([ids], device=device), attention_mask=masks, position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def close(self) -> None:
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._offload.cleanup()
