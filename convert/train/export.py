"""The trained modules' tensors under the checkpoint's canonical names (layout/checkpoint_spec.py).

transformers keeps a layer's routed experts fused ([E, 2I, H] gate_up_proj, [E, H, I] down_proj)
and each PLE table whole; the checkpoint stores one gate/up/down weight per expert and the table in
`split_ngram_parts` row shards (torch.chunk, as transformers' save_pretrained splits it). The MTP
head's names get the `mtp.` prefix. Every name the spec lists must come out, and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from transformers import Qwen4ExpForCausalLM

from flashpack.layout.checkpoint_spec import MTP_PREFIX, iter_specs
from flashpack.layout.model_config import TextConfig

_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_FUSED_DOWN = "mlp.experts.down_proj"
_PLE_TABLE = "ple.ple_embedding.ngram_embedding.weight"


def canonical_tensors(lm: Qwen4ExpForCausalLM, mtp: nn.Module, cfg: TextConfig) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor (detached, on the CPU, in the modules' dtype) for the whole model."""
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in lm.state_dict().items():
        tensors.update(_split(key.removeprefix("model."), tensor.detach().cpu(), cfg))
    tensors.update(mtp_tensors(mtp, cfg))
    expected = {spec.name: spec.shape for spec in iter_specs(cfg, with_mtp=cfg.mtp_num_hidden_layers > 0)}
    missing = sorted(set(expected) - set(tensors))
    stray = sorted(set(tensors) - set(expected))
    wrong = [name for name in expected if name in tensors and tuple(tensors[name].shape) != expected[name]]
    if missing or stray or wrong:  # the trainer's modules and the spec disagree: a bug, not user input
        raise AssertionError(f"export does not match the checkpoint spec: missing {missing[:3]}, "
                             f"stray {stray[:3]}, wrong shapes {wrong[:3]}")
    return tensors


def mtp_tensors(mtp: nn.Module, cfg: TextConfig) -> dict[str, torch.Tensor]:
    """The MTP head's tensors under their `mtp.*` canonical names."""
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in mtp.state_dict().items():
        tensors.update(_split(MTP_PREFIX + key, tensor.detach().cpu(), cfg))
    return tensors


def _split(name: str, tensor: torch.Tensor, cfg: TextConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if name.endswith(_FUSED_GATE_UP):
        prefix, inter = name.removesuffix("gate_up_proj"), cfg.moe_intermediate_size
        for expert, gate_up in enumerate(tensor):
            yield f"{prefix}{expert}.gate_proj.weight", gate_up[:inter].contiguous()
            yield f"{prefix}{expert}.up_proj.weight", gate_up[inter:].contiguous()
    elif name.endswith(_FUSED_DOWN):
        prefix = name.removesuffix("down_proj")
        for expert, down in enumerate(tensor):
            yield f"{prefix}{expert}.down_proj.weight", down.contiguous()
    elif name.endswith(_PLE_TABLE):
        prefix = name.removesuffix("weight")
        for shard, rows in enumerate(torch.chunk(tensor, cfg.split_ngram_parts)):
            yield f"{prefix}shard_{shard}.weight", rows.contiguous()
    else:
        yield name, tensor
