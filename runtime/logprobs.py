"""The model's own log-probabilities of tokens: what `logprobs` asks for in the OpenAI APIs.

A log-probability here is log-softmax of the raw logits at temperature 1, in float32: the unmodified
model's distribution (what OpenAI reports and vLLM reports by default), whatever temperature, top-k,
top-p or grammar then chose the token. Each position also names its `top_n` most likely tokens.

A prompt's log-probabilities come from the prefill's hidden streams, turned into logits a slice of
rows at a time, so a long prompt never holds [T, vocab] logits at once (a 262k-token prompt over a
248k vocabulary would be 260 GB in float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Logits rows per slice: about this many float32 values (64 MiB) at once, whatever the vocabulary.
SLICE_VALUES = 1 << 24


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the top_n most likely (id, logprob) there, most likely first


@dataclass(frozen=True)
class LogprobRequest:
    """What a request wants reported besides its text."""

    top_n: int = 0  # alternatives at each position (0: only the token's own log-probability)
    prompt: bool = False  # the prompt's tokens too, each given those before it (the first has none)


def log_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """Logits [..., vocab] in any dtype -> float32 log-softmax over the vocabulary."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> list[TokenLogprob]:
    """Logits [T, vocab] and the token chosen at each of the T positions -> one TokenLogprob each."""
    logp = log_probabilities(logits)
    chosen = logp.gather(1, token_ids.to(logp.device).long()[:, None])[:, 0].tolist()
    if top_n > 0:
        values, ids = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)
        tops = [tuple(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(int(token), value, top) for token, value, top in zip(token_ids.tolist(), chosen, tops)]


def prompt_logprobs(model, streams: torch.Tensor, prompt_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """The prompt's tokens 1..T-1, each given those before it, from the prefill's streams [T, hc*H]
    (`model.logits` turns streams into logits; row t predicts token t + 1)."""
    targets = torch.tensor(prompt_ids[1:], dtype=torch.int64)
    predicting = streams[: len(targets)]
    rows = max(1, SLICE_VALUES // int(model.config.vocab_size))
    found: list[TokenLogprob] = []
    for start in range(0, len(targets), rows):
        logits = model.logits(predicting[start : start + rows])
        found += token_logprobs(logits, targets[start : start + rows], top_n)
    return found
