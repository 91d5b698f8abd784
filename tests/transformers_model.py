"""transformers' own Qwen4ExpForCausalLM, loaded whole with the weights verify derives from a
snapshot (verify/expected.py: dense tensors BF16-rounded, experts NVFP4-rounded, PLE rows
FP8-rounded): the oracle the tests run the ordinary way, a full forward pass."""

from __future__ import annotations

import torch
from transformers import Qwen4ExpForCausalLM

from flashpack.verify.expected import ExpectedWeights
from flashpack.verify.reference import transformers_config


def full_model(weights: ExpectedWeights) -> Qwen4ExpForCausalLM:
    cfg = weights.config
    model = Qwen4ExpForCausalLM(transformers_config(cfg.raw)).eval()
    state = {}
    for key, tensor in model.state_dict().items():
        name = key.removeprefix("model.")
        if ".mlp.experts." in name or "ngram_embedding" in name:
            continue  # set below: experts one by one, the PLE table row by row
        state[key] = weights.dense(name) if tensor.is_floating_point() else weights.buffer(name)
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        for layer, block in enumerate(model.model.layers):
            for expert in range(cfg.num_experts):
                w = weights.expert(layer, expert)
                block.mlp.experts.gate_up_proj[expert] = torch.cat([w.gate, w.up])
                block.mlp.experts.down_proj[expert] = w.down
            if block.ple is not None:
                table = block.ple.ple_embedding.ngram_embedding.weight
                table.copy_(weights.ple_rows(cfg.ple_index(layer), torch.arange(table.shape[0])))
    return model
