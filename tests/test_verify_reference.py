"""verify's layer-at-a-time reference is transformers' full model, bit for bit.

The full `Qwen4ExpForCausalLM` is loaded whole with the same weights verify derives from the
snapshot (dense in BF16, experts NVFP4-rounded, PLE rows FP8-rounded) and run the ordinary way:
prefill, then one cached decode step per token. Layer-major order, lazily loaded experts and the
PLE row gather must change nothing: every layer's output and the logits are identical.
"""

from __future__ import annotations

import inspect

import torch
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

from flashpack.convert.source import SourceCheckpoint
from flashpack.verify.expected import ExpectedWeights
from flashpack.verify.inputs import default_sequences
from flashpack.verify.reference import DELTA_RULE_FUNCTIONS, LayerwiseReference
from tests.transformers_model import full_model


def _run_full(model, sequence) -> tuple[list[torch.Tensor], torch.Tensor]:
    captured = [[] for _ in model.model.layers]
    hooks = [layer.register_forward_hook(lambda _m, _a, out, chunks=chunks: chunks.append(out[0]))
             for layer, chunks in zip(model.model.layers, captured)]
    try:
        with torch.no_grad():
            cache, logits = None, []
            for step in sequence.steps:
                out = model(torch.tensor([step]), past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                logits.append(out.logits[0])
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat(chunks) for chunks in captured], torch.cat(logits)


def test_layerwise_reference_equals_full_transformers_model(tiny_nvfp4_snapshot):
    snapshot = SourceCheckpoint.open(tiny_nvfp4_snapshot)
    weights = ExpectedWeights(snapshot, dense_fp8_rows=False)
    sequences = default_sequences(weights.config, decode_tokens=4)
    layers: dict[int, list[torch.Tensor]] = {}
    logits = LayerwiseReference(weights).run(sequences, lambda layer, outs: layers.__setitem__(layer, outs))
    model = full_model(weights)
    for index, sequence in enumerate(sequences):
        full_layers, full_logits = _run_full(model, sequence)
        for layer, expected in enumerate(full_layers):
            assert torch.equal(layers[layer][index], expected), f"{sequence.name} layer {layer}"
        assert torch.equal(logits[index], full_logits), sequence.name


def test_reference_runs_transformers_own_delta_rule_where_a_kernel_is_bound(tiny_nvfp4_snapshot, monkeypatch):
    """Where fla is installed, transformers binds its kernels to the delta-rule names at import; the
    reference runs the PyTorch functions they wrap instead, and puts the bound ones back after."""
    stand_ins = {}
    for name in DELTA_RULE_FUNCTIONS:
        def kernel(*args, **kwargs):
            raise AssertionError("the reference called the bound kernel")

        kernel.__wrapped__ = inspect.unwrap(getattr(hf, name))
        monkeypatch.setattr(hf, name, kernel)
        stand_ins[name] = kernel
    weights = ExpectedWeights(SourceCheckpoint.open(tiny_nvfp4_snapshot), dense_fp8_rows=False)
    sequences = default_sequences(weights.config, decode_tokens=2)
    logits = LayerwiseReference(weights).run(sequences)
    assert all(torch.isfinite(value).all() for value in logits)
    assert all(getattr(hf, name) is kernel for name, kernel in stand_ins.items())
