"""`flashpack verify PACK --reference SNAPSHOT`: our engine on the pack against transformers on the snapshot.

    checks   the pack opens (files, schema version); the snapshot is the pack's source (config,
             file sizes and hashes); the inputs fit the context
    ours     the engine from the pack, every decoder layer's streams and the logits captured
    ref      transformers' layers one at a time, fed the snapshot's weights as the pack should
             hold them (FP32); in BF16 a second, BF16 pass measures the floor the gates scale from
    report   per layer and logits: max abs, relative error, cosine; KL and top-1; pass or fail

With `control`, the same runs on a deliberately broken, self-consistent copy of the pack, which
must fail (controls.py).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from flashpack.errors import FlashpackError
from flashpack.layout.model_config import TextConfig
from flashpack.layout.pack import Pack
from flashpack.verify.compare import FP32, bf16_logit_gates, bf16_rel_gate, logit_stats, merge_logit_stats, worst
from flashpack.verify.compare import errors as measure
from flashpack.verify.controls import CONTROLS, make_control
from flashpack.verify.expected import ExpectedWeights
from flashpack.verify.inputs import Sequence, check_sequences, default_sequences, prompt_sequences
from flashpack.verify.match import open_reference
from flashpack.verify.ours import run_engine
from flashpack.verify.reference import LayerwiseReference
from flashpack.verify.report import Row, VerifyReport

TRITON_F32_DEFAULT = "TRITON_F32_DEFAULT"  # Triton's default precision of float32 dots
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def verify_pack(
    pack: Path,
    reference: Path | str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    prompts: list[str] | None = None,
    decode_tokens: int = 8,
    control: str | None = None,
    json_path: Path | None = None,
    seed: int = 0,
    progress: bool = False,
) -> VerifyReport:
    """Verify `pack` against its source snapshot `reference`; `report.passed` is the verdict.

    dtype: the engine's compute dtype, "float32" or "bfloat16" (the reference is always FP32).
    prompts: texts for the pack's tokenizer (each one's last `decode_tokens` tokens are decoded
    teacher-forced); None: random sequences sized to exercise the indexer and PLE (inputs.py).
    control: one of controls.CONTROLS: verify a broken copy instead, which must fail.
    progress: progress bars while hashing the reference snapshot, running the engine and the reference.
    """
    if dtype not in DTYPES:
        raise FlashpackError(f"unsupported dtype {dtype!r}: use float32 or bfloat16")
    if control is not None and control not in CONTROLS:
        raise FlashpackError(f"unknown control {control!r}: choose one of {', '.join(CONTROLS)}")
    if decode_tokens < 0:
        raise FlashpackError("--decode-tokens must be 0 or more")
    opened = Pack.open(pack)
    try:
        snapshot = open_reference(opened.manifest, reference, progress)
        cfg = opened.manifest.config
        sequences = (
            prompt_sequences(opened.root, prompts, decode_tokens) if prompts
            else default_sequences(cfg, decode_tokens, seed)
        )
        check_sequences(cfg, sequences)
        if control is None:
            report = _verify(opened, snapshot, sequences, dtype, device, progress)
        else:
            with tempfile.TemporaryDirectory(prefix=f".{opened.root.name}.control-", dir=opened.root.parent) as work:
                broken = Pack.open(make_control(opened, control, Path(work)))
                try:
                    report = _verify(broken, snapshot, sequences, dtype, device, progress)
                finally:
                    broken.close()
            report.control = control
    finally:
        opened.close()
    report.pack, report.reference = str(pack), str(reference)
    if json_path is not None:
        report.write_json(json_path)
    return report


@contextmanager
def ieee_fp32() -> Iterator[None]:
    """FP32 means FP32 on CUDA too: no TF32 in matmuls, cuDNN convolutions or Triton dots while verify
    runs. Triton's dots default to TF32 for float32 operands, and flash-linear-attention's chunked
    DeltaNet kernels (which our engine calls on a GPU; the reference runs transformers' PyTorch
    delta rule, reference.py) leave that default;
    TRITON_F32_DEFAULT is read as a kernel is compiled, so kernels built inside the block are IEEE."""
    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = [flag.allow_tf32 for flag in flags]
    saved_env = os.environ.get(TRITON_F32_DEFAULT)
    for flag in flags:
        flag.allow_tf32 = False
    os.environ[TRITON_F32_DEFAULT] = "ieee"
    try:
        yield
    finally:
        for flag, value in zip(flags, saved):
            flag.allow_tf32 = value
        if saved_env is None:
            os.environ.pop(TRITON_F32_DEFAULT, None)
        else:
            os.environ[TRITON_F32_DEFAULT] = saved_env


def _verify(pack: Pack, snapshot, sequences: list[Sequence], dtype: str, device: str, progress: bool) -> VerifyReport:
    with ieee_fp32():
        return _run_and_compare(pack, snapshot, sequences, dtype, device, progress)


def _run_and_compare(
    pack: Pack, snapshot, sequences: list[Sequence], dtype: str, device: str, progress: bool,
) -> VerifyReport:
    cfg = pack.manifest.config
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    ours = run_engine(pack, sequences, DTYPES[dtype], device, progress)
    seconds["engine"] = time.perf_counter() - started

    expected = ExpectedWeights(snapshot, dense_fp8_rows=bool(pack.manifest.document["dense"]["fp8_rows"]))
    bf16 = DTYPES[dtype] == torch.bfloat16
    rows: list[Row] = []
    truth: dict[int, list[torch.Tensor]] = {}

    def compare_layer(layer: int, refs: list[torch.Tensor]) -> None:
        ours_layer = [trace.layers[layer] for trace in ours]
        rows.append(Row(f"layer {layer}", _kind(cfg, layer), _phases(sequences, ours_layer, refs), FP32.rel))
        if bf16:
            truth[layer] = refs  # kept for the floor pass

    started = time.perf_counter()
    ref_logits = LayerwiseReference(expected, torch.float32, device).run(sequences, compare_layer, progress)
    seconds["reference"] = time.perf_counter() - started
    rows.append(Row("logits", "logits", _phases(sequences, [t.logits for t in ours], ref_logits), FP32.rel))
    stats = merge_logit_stats([logit_stats(t.logits, ref) for t, ref in zip(ours, ref_logits)])
    kl_gate, top1_gate = FP32.kl_mean, FP32.top1

    if bf16:
        def floor_layer(layer: int, refs16: list[torch.Tensor]) -> None:
            floor = worst(*(e for p in _phases(sequences, refs16, truth.pop(layer)).values() for e in p.values())).rel
            rows[layer].floor, rows[layer].tolerance = floor, bf16_rel_gate(floor)

        started = time.perf_counter()
        floor_logits = LayerwiseReference(expected, torch.bfloat16, device).run(sequences, floor_layer, progress)
        seconds["bf16_floor"] = time.perf_counter() - started
        phases = _phases(sequences, floor_logits, ref_logits)
        rows[-1].floor = worst(*(e for p in phases.values() for e in p.values())).rel
        rows[-1].tolerance = bf16_rel_gate(rows[-1].floor)
        kl_gate, top1_gate = bf16_logit_gates(
            merge_logit_stats([logit_stats(floor, ref) for floor, ref in zip(floor_logits, ref_logits)])
        )

    return VerifyReport(
        pack=str(pack.root), reference=str(snapshot.root), dtype=dtype, device=device, sequences=sequences,
        rows=rows, logit_stats=stats, kl_gate=kl_gate, top1_gate=top1_gate, seconds=seconds,
    )


def _phases(sequences: list[Sequence], ours: list[torch.Tensor], refs: list[torch.Tensor]) -> dict[str, dict]:
    """Errors per sequence, prefill positions and decode positions apart."""
    phases = {}
    for seq, a, b in zip(sequences, ours, refs):
        split = len(seq.prefill)
        phases[seq.name] = {"prefill": measure(a[:split], b[:split])}
        if seq.decode:
            phases[seq.name]["decode"] = measure(a[split:], b[split:])
    return phases


def _kind(cfg: TextConfig, layer: int) -> str:
    return cfg.layer_types[layer] + ("+ple" if cfg.ple_index(layer) is not None else "")
