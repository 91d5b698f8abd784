"""Compiled pieces (runtime/model/compiled.py, EngineConfig.compile_prompt_pieces): the plain tensor
code between the layers' kernels of their own (mixes, combines, router and shared expert, DeltaNet's
projections, conv and output norm, attention's projections and output), compiled by torch.compile
with the step length dynamic, computes what the plain pieces do (FP32 on the CPU: within TorchInductor's
fused summation order; BF16 on a GPU: the same greedy tokens), for prompts of several lengths, a
follow-up and a step with checkpoints, and is compiled once for every layer, not once a layer.
Control: a piece that reads its layer's index is compiled again for each layer, so the count can
tell."""

from __future__ import annotations

import pytest
import torch

from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.model.decoder_layer import mixer_input, moe_input, moe_output
from flashpack.runtime.model.deltanet import step_inputs, step_output
from flashpack.runtime.model.qsa_attention import gated_output, projected

TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # float32: the fused kernels sum a norm's squares in another order
PIECES = [mixer_input, moe_input, moe_output, step_inputs, step_output, projected, gated_output]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _ids(count: int, seed: int) -> torch.Tensor:
    return torch.randint(5, 1000, (count,), generator=torch.Generator().manual_seed(seed))


def _engines(tiny_pack, device: str):
    dtype = "float32" if device == "cpu" else "bfloat16"
    return [load_engine(tiny_pack, EngineConfig(device=device, dtype=dtype, compile_prompt_pieces=compiled,
                                                prompt_cache_ram=0, speculate="off", cuda_graphs=False))
            for compiled in (False, True)]


def _steps(engine, lengths: list[int], marks: list[int]) -> list[torch.Tensor]:
    """Logits of a prompt and its follow-ups (the last of them with checkpoints `marks`)."""
    step, state, logits = engine.step, engine.step.new_state(), []
    for index, length in enumerate(lengths):
        last = index == len(lengths) - 1
        out = step.forward(_ids(length, index).to(engine.config.device), state, marks=marks if last else ())
        logits.append(out.logits.float().cpu())
    return logits


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_pieces_compute_what_the_plain_pieces_do(tiny_pack, device):
    plain, compiled = _engines(tiny_pack, device)
    lengths, marks = [70, 25, 7, 1, 40], [9, 30]
    expected, found = _steps(plain, lengths, marks), _steps(compiled, lengths, marks)
    for want, got in zip(expected, found):
        if device == "cpu":
            torch.testing.assert_close(got, want, **TOLERANCE)
        else:  # BF16: the fused kernels round once where the plain ones round after each operation
            assert float((got - want).norm() / want.norm()) < 2e-2
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def _variants(fn) -> int:
    """The compiled variants dynamo holds for `fn`'s code."""
    return len(_debug_get_cache_entry_list(fn.__code__))


def test_each_piece_is_compiled_once_for_every_layer_and_length(tiny_pack):
    _, compiled = _engines(tiny_pack, "cpu")
    layers = compiled.model.layers
    assert len(layers) > 2 and any(layer.linear for layer in layers) and not all(layer.linear for layer in layers)
    torch._dynamo.reset()  # the variants other tests' lengths compiled
    _steps(compiled, [70], [])
    # one variant a piece for every layer of a kind (a variant a layer would hold one per layer)
    assert [_variants(fn) for fn in PIECES] == [1] * len(PIECES)
    # other lengths past the tile kernels' 16 tokens, under and over the plain rule's 64-token chunk,
    # and a step with checkpoints (its recurrence's output a concatenation): nothing new
    _steps(compiled, [90, 33, 150], [40, 100])
    assert [_variants(fn) for fn in PIECES] == [1] * len(PIECES)


def test_control_a_piece_that_reads_its_layer_index_compiles_once_a_layer(tiny_pack):
    plain, _ = _engines(tiny_pack, "cpu")

    def indexed_input(layer, streams):
        block_input, inject = mixer_input(layer, streams)
        return block_input * (1 + layer.layer * 0), inject

    compiled = torch.compile(indexed_input, dynamic=True, backend="eager")
    streams = torch.randn(9, plain.model.config.hc_count * plain.model.config.hidden_size)
    for layer in plain.model.layers:
        compiled(layer, streams)
    assert _variants(indexed_input) == len(plain.model.layers)
