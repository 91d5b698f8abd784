"""Train the demo model end to end: corpus, tokenizer, windows, model, loop, evaluation, snapshot.

Deterministic given the seed: python's, numpy's and torch's generators are seeded, the tokenizer is
trained on the corpus in its fixed order, and windows are read in a seeded order (windows.py). On a
GPU the model is BF16 with float32 master weights (optimizer.py) and DeltaNet runs on
flash-linear-attention's kernels when `fla` is importable (transformers picks them up itself; fla-core
0.6.0 refuses their backward on Hopper under Triton < 3.7.1, see demo_model/TRAINING.md); on a CPU
everything is float32, for the smoke test.

The loop itself (schedule, logging, the divergence guard) is loop.py. A schedule fixed by a time
budget is written into the record as its total steps, so a rerun with `steps` set replays it.
"""

from __future__ import annotations

import json
import platform
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashpack.convert.train import model_config
from flashpack.convert.train.corpus import load_corpus
from flashpack.convert.train.evaluate import evaluate, unigram_log_probs
from flashpack.convert.train.export import canonical_tensors
from flashpack.convert.train.loop import TrainingLoop
from flashpack.convert.train.optimizer import MasterWeightAdamW
from flashpack.convert.train.snapshot import check_output, write_snapshot
from flashpack.convert.train.tokenizer import load_tokenizer, train_tokenizer
from flashpack.convert.train.settings import TrainSettings
from flashpack.convert.train.training_model import DemoModel
from flashpack.convert.train.windows import Windows, token_stream
from flashpack.errors import FlashpackError
from flashpack.layout.model_config import TextConfig

RECORD_NAME = "training-record.json"
SNAPSHOT_NAME = "snapshot"


def train(out: Path, settings: TrainSettings, force: bool = False, log=print) -> dict[str, Any]:
    """Train, evaluate, write out/snapshot and out/training-record.json; returns the record."""
    out = Path(out)
    record_path = out / RECORD_NAME
    if record_path.exists() and not force:
        raise FlashpackError(f"{record_path} already exists; pass --force to overwrite it")
    check_output(out / SNAPSHOT_NAME, force)  # before training, not after it
    device = _device(settings.device)
    _seed_everything(settings.seed)
    started = time.perf_counter()

    corpus = load_corpus(settings.max_train_files, settings.max_held_out_files)
    tokens = model_config.special_tokens(settings.size)
    tokenizer_started = time.perf_counter()
    if settings.tokenizer_dir is not None:
        tokenizer = load_tokenizer(settings.tokenizer_dir, tokens)
    else:
        tokenizer = train_tokenizer((source.text for source in corpus.train), tokens)
    tokenizer_s = time.perf_counter() - tokenizer_started
    train_stream = token_stream(tokenizer, [s.text for s in corpus.train], tokens.endoftext)
    held_out_stream = token_stream(tokenizer, [s.text for s in corpus.held_out], tokens.endoftext)
    train_windows = Windows(train_stream, settings.sequence_length)
    held_out = Windows(held_out_stream, settings.sequence_length)
    unigram = unigram_log_probs(train_stream, tokens.vocab_size)
    log(f"corpus: {len(corpus.train)} + {len(corpus.held_out)} files, {train_stream.numel():,} + "
        f"{held_out_stream.numel():,} tokens; tokenizer {tokenizer_s:.1f} s")

    text_config = model_config.text_config_dict(settings.size)
    config = model_config.transformers_config(settings.size)
    config._attn_implementation = "eager" if settings.losses.indexer else "sdpa"  # eager returns probabilities
    model = DemoModel(config, text_config["mtp_num_hidden_layers"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model.to(device=device, dtype=dtype).train()
    optimizer = MasterWeightAdamW(model, settings.weight_decay, settings.betas, settings.clip_norm)

    loop = TrainingLoop(model, optimizer, settings, device)
    curve, evals = loop.run(train_windows, held_out, unigram, log)
    final = evaluate(model, held_out, unigram, settings.batch_size, device)
    log("held-out: " + json.dumps({k: round(v, 4) for k, v in final.items()}))

    summary = {
        "corpus_version": corpus.version,
        "seed": settings.seed,
        "steps": loop.steps_done,
        "tokens_seen": loop.tokens_seen,
        "held_out_loss": final["loss"],
        "unigram_loss": final["unigram_loss"],
        "mtp_agreement": final["mtp_agreement_with_greedy"],
    }
    cfg = TextConfig.from_text_dict(text_config)
    tensors = canonical_tensors(model.lm, model.mtp, cfg)
    write_snapshot(out / SNAPSHOT_NAME, tensors, text_config, model_config.vision_config(settings.size),
                   tokenizer, tokens, summary, force=force)
    record = {
        "settings": _jsonable(asdict(settings)),
        "corpus": corpus.summary(),
        "tokens": {"train": train_stream.numel(), "held_out": held_out_stream.numel(),
                   "train_windows": train_windows.count, "held_out_windows": held_out.count,
                   "bytes_per_token_held_out": corpus.summary()["held_out_bytes"] / max(1, held_out_stream.numel())},
        "model": {"text_config": text_config, "parameters": model_config.parameter_counts(settings.size),
                  "snapshot_bytes_by_part": model_config.byte_counts(settings.size)},
        "schedule": {"total_steps": loop.schedule.total_steps if loop.schedule else None,
                     "warmup_steps": settings.warmup_steps, "peak_lr": settings.peak_lr},
        "steps": loop.steps_done,
        "tokens_seen": loop.tokens_seen,
        "stopped_early": loop.stopped_early,
        "epochs": loop.tokens_seen / max(1, train_stream.numel()),
        "train_wall_s": loop.wall_s,
        "tokens_per_s": loop.tokens_seen / max(loop.wall_s, 1e-9),
        "total_wall_s": time.perf_counter() - started,
        "tokenizer_s": tokenizer_s,
        "loss_curve": curve,
        "held_out_curve": evals,
        "final": final,
        "machine": _machine(device),
    }
    out.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return record


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise FlashpackError("--device cuda asked for, but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise FlashpackError(f"unknown device {name!r}: choose auto, cpu or cuda")
    return torch.device(name)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _machine(device: torch.device) -> dict[str, Any]:
    import tokenizers
    import transformers

    try:
        import fla

        fla_version = getattr(fla, "__version__", "unknown")
    except ImportError:
        fla_version = None
    on_gpu = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu",
        "peak_device_memory_bytes": torch.cuda.max_memory_allocated(device) if on_gpu else None,
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "fla": fla_version,
    }


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
