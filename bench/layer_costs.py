"""What one decode token costs per kind of layer, on the GPU with CUDA graphs: the basis for scaling a
pack cut to a few layers up to the full 48.

    python bench/layer_costs.py PACK --out DIR

Times S greedy steps two ways: as they run (asynchronous, a graph a layer launched while the layer
before runs: the real step time), and with a device synchronize after each layer's graph, so each
layer's time (issue + run) can be told apart by kind: the PLE layer, DeltaNet layers, QSA attention layers, and the
fixed part (embedding, PLE rows, final mixer, lm_head, argmax). The full model's step is then
estimated as
    fixed + ple_layer + (linear_layers - ple_layers) * deltanet + attention_layers * attention
from the synchronised costs (an upper bound: it removes the overlap of host and device work),
and also scaled by the ratio asynchronous / synchronised measured on the pack itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from flashpack.runtime.loader import StoreOptions, load_engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pack")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--full-layers", type=int, default=48)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    engine = load_engine(args.pack, "cuda", store=StoreOptions())
    model, cfg = engine.model, engine.model.config
    if model.decode_graphs is None:
        raise SystemExit("layer_costs needs the resident, CUDA-graph decode path (a GPU and every expert in VRAM)")
    state = model.new_state()
    token = int(model(torch.randint(0, 1000, (args.prompt_len,)), state, last_only=True).logits.argmax())
    for _ in range(4):  # eager, capture, replay
        token = int(model(torch.tensor([token]), state).logits.argmax())

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        token = int(model(torch.tensor([token]), state).logits.argmax())
    async_step = (time.perf_counter() - start) / args.steps

    kinds: dict[str, list[float]] = {"fixed": [], "ple": [], "deltanet": [], "attention": []}
    for _ in range(args.steps):
        torch.cuda.synchronize()
        mark = time.perf_counter()
        per_step = {kind: 0.0 for kind in kinds}

        def after_layer(layer) -> None:
            nonlocal mark
            torch.cuda.synchronize()
            now = time.perf_counter()
            kind = "ple" if layer.ple is not None else ("deltanet" if layer.linear else "attention")
            per_step[kind] += now - mark
            mark = now

        tokens = torch.tensor([token])
        streams = model.embed(tokens.to(model.device)).repeat(1, cfg.hc_count)
        torch.cuda.synchronize()
        per_step["fixed"] += time.perf_counter() - mark
        mark = time.perf_counter()
        streams, _ = model.decode_graphs.run(streams, tokens, state, after_layer=after_layer)
        state.position += 1
        token = int(model.logits(streams[-1:]).argmax())
        per_step["fixed"] += time.perf_counter() - mark
        for kind in kinds:
            kinds[kind].append(per_step[kind])
    layers = model.layers
    counts = {"ple": sum(layer.ple is not None for layer in layers),
              "deltanet": sum(layer.linear and layer.ple is None for layer in layers),
              "attention": sum(not layer.linear for layer in layers)}
    per_layer = {kind: statistics.median(kinds[kind]) / counts[kind] for kind in counts if counts[kind]}
    fixed = statistics.median(kinds["fixed"])
    synced_step = fixed + sum(statistics.median(kinds[k]) for k in counts)
    interval = cfg.num_hidden_layers // max(1, sum(not layer.linear for layer in layers))  # 4: 3 DeltaNet + 1 QSA
    full_attention = args.full_layers // interval
    full_counts = {"ple": counts["ple"], "deltanet": args.full_layers - full_attention - counts["ple"],
                   "attention": full_attention}
    full_synced = fixed + sum(per_layer.get(k, 0.0) * n for k, n in full_counts.items())
    result = {
        "pack_layers": len(layers), "layer_counts": counts, "steps": args.steps, "prompt_tokens": args.prompt_len,
        "async_step_ms": async_step * 1e3, "synced_step_ms": synced_step * 1e3,
        "fixed_ms": fixed * 1e3, "per_layer_ms": {k: v * 1e3 for k, v in per_layer.items()},
        "full_layers": args.full_layers, "full_layer_counts": full_counts,
        "full_step_ms_synced": full_synced * 1e3,
        "full_step_ms_scaled": full_synced * async_step / synced_step * 1e3,
        "full_tokens_per_s_scaled": synced_step / (full_synced * async_step),
        "gpu": torch.cuda.get_device_name(),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "layer-costs.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
