"""Open a pack as a ready engine: model, tokenizer and generator, on the requested device."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flashpack.errors import FlashpackError
from flashpack.layout.pack import Pack
from flashpack.runtime.experts import ExpertFetcher
from flashpack.runtime.generate import Generator
from flashpack.runtime.model.model import Qwen4ExpModel
from flashpack.runtime.pack_source import PackExperts, PackWeights
from flashpack.runtime.tokenizer import PackTokenizer

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


@dataclass
class LoadedEngine:
    pack: Pack
    model: Qwen4ExpModel
    tokenizer: PackTokenizer
    generator: Generator


def parse_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is BF16 on a GPU and FP32 on a CPU, where BF16 matmuls are emulated and slower."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise FlashpackError(f"unknown dtype {name!r}: use one of {', '.join(sorted(DTYPES))}") from None


def parse_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FlashpackError("--device cuda was asked for but no CUDA device is available")
    return device


def load_engine(
    pack_path: Path | str,
    device: str = "cpu",
    dtype: str = "auto",
    fetcher: ExpertFetcher | None = None,
    verify_records: bool = True,
) -> LoadedEngine:
    pack = Pack.open(pack_path)
    torch_device = parse_device(device)
    model = Qwen4ExpModel(
        PackWeights(pack),
        fetcher or PackExperts(pack, verify_records=verify_records),
        dtype=parse_dtype(dtype, torch_device),
        device=torch_device,
    )
    tokenizer = PackTokenizer.load(pack.root)
    return LoadedEngine(pack, model, tokenizer, Generator(model, tokenizer))
