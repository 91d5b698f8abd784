"""flashpack's own qwen4_exp engine: plain PyTorch modules, one concept per file.

    Qwen4ExpModel(source, fetcher, dtype, device)   backbone step: forward(tokens, state) -> StepOutput
    MTPHead(model, source, fetcher)                 draft head: forward(streams, next_tokens, state)
"""

from flashpack.runtime.model.model import Qwen4ExpModel, StepOutput
from flashpack.runtime.model.mtp import DraftOutput, MTPHead

__all__ = ["DraftOutput", "MTPHead", "Qwen4ExpModel", "StepOutput"]
