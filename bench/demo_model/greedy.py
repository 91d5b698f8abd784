"""Greedy tokens: transformers' `generate(do_sample=False)` against the engine's own greedy loop.

Each comparison counts equal tokens position by position and describes where a prompt's tokens
first part: the token each side chose and, from transformers' logits at that step, how far apart
the two tokens' logits were. Two FP32 implementations of the same weights differ by rounding
(~1e-6 relative in the logits), so with identical weights a divergence is explained only by a
logit tie: a margin under TIE_MARGIN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashpack.runtime.model import Qwen4ExpModel

# FP32 rounding moves the demo's logits (|logit| up to ~30) by ~1e-5; 1e-3 is 100x that.
TIE_MARGIN = 1e-3


@dataclass(frozen=True)
class Generated:
    tokens: list[int]
    logits: list[torch.Tensor]  # [vocab] float32 per step: what each token was chosen from


@torch.no_grad()
def transformers_greedy(model, prompt: list[int], steps: int) -> Generated:
    """`steps` tokens: the model's generation config (sources.transformers_model) has no eos to stop at."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, return_dict_in_generate=True,
                         output_logits=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    if len(tokens) != steps:
        raise RuntimeError(f"transformers generated {len(tokens)} tokens where {steps} were asked for")
    return Generated(tokens, [step[0].float() for step in out.logits])


@torch.no_grad()
def engine_greedy(model: Qwen4ExpModel, prompt: list[int], steps: int) -> Generated:
    """Prefill the prompt, then one token a forward, the argmax each time."""
    state = model.new_state()
    logits = model(torch.tensor(prompt), state, last_only=True).logits[-1].float()
    tokens, chosen_from = [], []
    for step in range(steps):
        tokens.append(int(logits.argmax()))
        chosen_from.append(logits)
        if step + 1 < steps:
            logits = model(torch.tensor(tokens[-1:]), state).logits[-1].float()
    return Generated(tokens, chosen_from)


def compare(reference: list[Generated], engine: list[Generated], paths: list[str]) -> dict:
    """Equal tokens over all prompts, and each prompt's first divergence (a tie or not)."""
    equal = total = 0
    divergences = []
    for path, ours, theirs in zip(paths, engine, reference):
        equal += sum(a == b for a, b in zip(ours.tokens, theirs.tokens))
        total += len(theirs.tokens)
        step = next((i for i, (a, b) in enumerate(zip(ours.tokens, theirs.tokens)) if a != b), None)
        if step is not None:
            divergences.append(_divergence(path, step, theirs, ours))
    return {"equal": equal, "total": total, "share_equal": equal / total if total else 0.0,
            "prompts_identical": len(paths) - len(divergences), "divergences": divergences,
            "all_explained_by_ties": all(d["tie"] for d in divergences)}


def _divergence(path: str, step: int, reference: Generated, engine: Generated) -> dict:
    theirs, ours = reference.tokens[step], engine.tokens[step]
    reference_margin = (reference.logits[step][theirs] - reference.logits[step][ours]).item()
    engine_margin = (engine.logits[step][ours] - engine.logits[step][theirs]).item()
    return {"prompt": path, "step": step, "reference_token": theirs, "engine_token": ours,
            "reference_margin": reference_margin, "engine_margin": engine_margin,
            "tie": reference_margin <= TIE_MARGIN and engine_margin <= TIE_MARGIN}
