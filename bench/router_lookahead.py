"""How well a layer's input predicts the experts of the layers after it: the ground for prefetching
the next layer's experts and reading the one after's from disk (`--read-ahead`).

    python bench/router_lookahead.py SNAPSHOT [--tokens 96] [--ahead 3] --json OUT

Runs transformers' own model on SNAPSHOT (a Hugging Face directory, e.g. from `flashpack synth`) over
random token ids, records each MoE block's input, and for each layer L and distance d applies layer
L + d's router to layer L's input: the share of layer L + d's actual top-k that this guess picks,
averaged over tokens. Prints and writes JSON: the mean share per distance and per layer.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("snapshot")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--ahead", type=int, default=3, help="the farthest distance d to measure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.snapshot, dtype=torch.float32).eval()
    config = model.config.get_text_config()
    layers = model.model.language_model.layers if hasattr(model.model, "language_model") else model.model.layers
    top_k = config.num_experts_per_tok
    inputs: dict[int, torch.Tensor] = {}

    def keep_input(index: int):
        return lambda module, hook_args: inputs.__setitem__(index, hook_args[0].reshape(-1, hook_args[0].shape[-1]))

    for index, layer in enumerate(layers):
        layer.mlp.register_forward_pre_hook(keep_input(index))
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        model(ids)

    def picks(layer: int, x: torch.Tensor) -> torch.Tensor:
        return torch.topk(x @ layers[layer].mlp.gate.weight.T, top_k, dim=-1).indices

    shares: dict[str, list[float]] = {}
    for distance in range(1, args.ahead + 1):
        per_layer = []
        for layer in range(len(layers) - distance):
            actual, guess = picks(layer + distance, inputs[layer + distance]), picks(layer + distance, inputs[layer])
            per_layer.append(statistics.fmean(len(set(a.tolist()) & set(g.tolist())) / top_k
                                              for a, g in zip(actual, guess)))
        shares[str(distance)] = per_layer
    result = {"snapshot": str(args.snapshot), "machine": platform.node(), "tokens": args.tokens, "top_k": top_k,
              "layers": len(layers), "mean_share": {d: statistics.fmean(v) for d, v in shares.items()},
              "per_layer": shares}
    print(json.dumps(result["mean_share"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
