"""Held-out loss, top-1 accuracy and the MTP head's agreement, the way the trainer scored them.

For a window x_0..x_{T+1} (convert/train/evaluate.py): the model reads x_0..x_{T-1} in one forward
and is scored on x_1..x_T (nats/token from the log-softmax of its logits). The MTP head then reads
the backbone's streams at each position p with the true x_{p+1} and drafts x_{p+2}; its top-1 is
compared with the model's own greedy choice there (its argmax at p + 1, having read x_{p+1}: what
a greedy speculative decoder would accept) and with the true x_{p+2}, for p < T - 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashpack.bench.demo_model.sources import Engine


@dataclass
class LossMeter:
    nll: float = 0.0
    tokens: int = 0
    correct: int = 0
    mtp_tokens: int = 0
    mtp_agree: int = 0
    mtp_correct: int = 0

    def add_main(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """logits [T, vocab] for targets [T]."""
        logits = logits.float()
        self.nll += F.cross_entropy(logits, targets, reduction="sum").item()
        self.tokens += targets.numel()
        self.correct += (logits.argmax(-1) == targets).sum().item()

    def add_mtp(self, mtp_logits: torch.Tensor, main_logits: torch.Tensor, window: torch.Tensor) -> None:
        """mtp_logits [T, vocab] drafting x_2..x_{T+1}; main_logits [T, vocab] over x_0..x_{T-1}."""
        drafts, greedy = mtp_logits[:-1].argmax(-1), main_logits[1:].argmax(-1)
        length = main_logits.shape[0]
        self.mtp_tokens += drafts.numel()
        self.mtp_agree += (drafts == greedy).sum().item()
        self.mtp_correct += (drafts == window[2:length + 1]).sum().item()

    def result(self) -> dict:
        loss = self.nll / self.tokens
        out = {"tokens": self.tokens, "loss": loss, "perplexity": math.exp(loss), "top1_accuracy": self.correct / self.tokens}
        if self.mtp_tokens:
            out.update(mtp_positions=self.mtp_tokens, mtp_agreement_with_greedy=self.mtp_agree / self.mtp_tokens,
                       mtp_accuracy=self.mtp_correct / self.mtp_tokens)
        return out


@torch.no_grad()
def transformers_loss(model, windows: list[torch.Tensor]) -> dict:
    """transformers' Qwen4ExpForCausalLM over each window in one forward (it runs no MTP head)."""
    meter = LossMeter()
    for window in windows:
        length = window.numel() - 2
        logits = model(window[None, :length]).logits[0]
        meter.add_main(logits, window[1:length + 1])
    return meter.result()


@torch.no_grad()
def engine_loss(engine: Engine, windows: list[torch.Tensor], with_mtp: bool = True) -> dict:
    """The engine's model over each window in one forward from a fresh state, then its MTP head
    over the window's streams and next tokens (the head keeps its own cache in that state)."""
    meter = LossMeter()
    for window in windows:
        length = window.numel() - 2
        state = engine.model.new_state()
        out = engine.model(window[:length], state)
        meter.add_main(out.logits, window[1:length + 1])
        if with_mtp:
            draft = engine.mtp(out.streams, window[1:length + 1], state)
            meter.add_mtp(draft.logits.float(), out.logits.float(), window)
    return meter.result()


def unigram_loss(log_probs: torch.Tensor, windows: list[torch.Tensor]) -> float:
    """The unigram baseline's nats/token on the same targets."""
    targets = torch.cat([window[1:window.numel() - 1] for window in windows])
    return -log_probs[targets].sum().item() / targets.numel()


def relative_gap(loss: float, reference: float) -> float:
    return (loss - reference) / reference
