"""Held-out numbers: the model's loss, the unigram baseline's, and the MTP head's top-1 agreement.

All over the same held-out windows and the same targets (x_1..x_T of each window; the MTP head's
x_2..x_{T+1}). The unigram baseline counts the training stream's tokens with add-one smoothing
over the whole vocabulary. MTP agreement at position p compares the head's top-1 draft of
x_{p+2} with the model's own greedy choice there (its top-1 at position p + 1, having read the
true x_{p+1}): what a greedy speculative decoder would accept. Accuracy compares with the true
x_{p+2}.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flashpack.convert.train.training_model import DemoModel
from flashpack.convert.train.windows import Windows


def unigram_log_probs(train_stream: torch.Tensor, vocab_size: int) -> torch.Tensor:
    counts = torch.bincount(train_stream.long(), minlength=vocab_size).double() + 1.0
    return (counts / counts.sum()).log()


@torch.no_grad()
def evaluate(
    model: DemoModel, windows: Windows, unigram: torch.Tensor, batch_size: int, device: torch.device,
    limit: int | None = None,
) -> dict[str, float]:
    was_training = model.training
    model.eval()
    main_nll = mtp_nll = unigram_nll = 0.0
    tokens = mtp_tokens = agree = mtp_correct = main_correct = 0
    for window in windows.in_order(batch_size, limit):
        window = window.to(device)
        length = window.shape[1] - 2
        predictions = model.predict(window)
        main_logits, mtp_logits = predictions.main_logits.float(), predictions.mtp_logits.float()
        targets, mtp_targets = window[:, 1 : length + 1], window[:, 2 : length + 2]
        main_nll += F.cross_entropy(main_logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        mtp_nll += F.cross_entropy(mtp_logits.flatten(0, 1), mtp_targets.flatten(), reduction="sum").item()
        unigram_nll -= unigram.to(device)[targets].sum().item()
        tokens += targets.numel()
        main_correct += (main_logits.argmax(-1) == targets).sum().item()
        drafts, greedy = mtp_logits[:, :-1].argmax(-1), main_logits[:, 1:].argmax(-1)
        agree += (drafts == greedy).sum().item()
        mtp_correct += (drafts == mtp_targets[:, :-1]).sum().item()
        mtp_tokens += drafts.numel()
    model.train(was_training)
    return {
        "tokens": tokens,
        "loss": main_nll / tokens,
        "perplexity": math.exp(main_nll / tokens),
        "unigram_loss": unigram_nll / tokens,
        "top1_accuracy": main_correct / tokens,
        "mtp_loss": mtp_nll / tokens,
        "mtp_agreement_with_greedy": agree / mtp_tokens,
        "mtp_accuracy": mtp_correct / mtp_tokens,
    }
