"""How far a checked step's logits are from plain decoding's, by how the step runs.

    python bench/checked_step_error.py PACK --device cuda [--hot-set '*'] [--gen 48] [--draft-tokens 4] --json OUT

Decodes GEN tokens greedily one token a step (decode graphs where the engine has them): the truth,
with each step's logits. Then from the state before each step, a tracked step of that token and
the next k true tokens, run three ways: from checked CUDA graphs, eagerly, and as one-token eager
steps (how far plain decoding's own two paths are apart). Per way and row: the largest and median
relative error of the logits against the truth's, and how often the row's argmax is the true next
token (a checked step accepts a right draft only where it is). Speculative greedy output equals plain
output only where that rate is 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from flashpack.layout.pack import Pack
from flashpack.runtime.bench.workload import prompt_ids
from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.settings import with_settings
from flashpack.runtime.store.config import StoreConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pack")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hot-set")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen", type=int, default=48)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine setting by name, as `flashpack bench --set` takes it")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    cfg = Pack.open(args.pack).manifest.config
    config = with_settings(EngineConfig(device=args.device, experts="store", store=StoreConfig(hot_set=args.hot_set),
                                        prompt_cache_ram=0, speculate="off"), args.settings)
    engine = load_engine(args.pack, config)
    step, k = engine.step, args.draft_tokens
    eos = cfg.eos_token_id if cfg.eos_token_id is not None and cfg.eos_token_id >= 0 else None
    prompt = prompt_ids(engine.tokenizer.tokenizer, cfg.vocab_size, args.prompt_len, 0, eos)
    state = step.new_state()
    state.reserve(args.prompt_len + args.gen + k + 2)
    out = step.forward(torch.tensor(prompt), state, last_only=True)
    tokens, logits, before = [int(out.logits[-1].argmax())], [], []
    for _ in range(args.gen):
        before.append(state.snapshot())
        out = step.forward(torch.tensor(tokens[-1:]), state, last_only=True)
        logits.append(out.logits[-1].float())
        tokens.append(int(out.logits[-1].argmax()))

    checked, graphs = step.checked, step.graphs

    def tracked(start: int) -> torch.Tensor:
        state.restore(before[start])
        state.track()
        rows = step.forward(torch.tensor(tokens[start:start + k + 1]), state).logits.float()
        state.restore(before[start])
        return rows

    def one_by_one(start: int) -> torch.Tensor:
        state.restore(before[start])
        rows = [step.forward(torch.tensor([t]), state, last_only=True).logits[-1].float()
                for t in tokens[start:start + k + 1]]
        return torch.stack(rows)

    ways = {}
    for name, run, use_checked, use_graphs in [("checked graphs", tracked, True, True), ("eager checked", tracked, False, True),
                                                 ("eager one-token", one_by_one, False, False)]:
        if name == "checked graphs" and checked is None:
            continue
        step.checked, step.graphs = (checked if use_checked else None), (graphs if use_graphs else None)
        errors, right = [[] for _ in range(k + 1)], [[] for _ in range(k + 1)]
        for start in range(args.gen - k):
            rows = run(start)
            for row in range(k + 1):
                truth = logits[start + row]
                errors[row].append(float((rows[row] - truth).norm() / truth.norm()))
                right[row].append(int(rows[row].argmax()) == tokens[start + row + 1])
        ways[name] = [{"row": row, "max_rel_error": max(errors[row]), "median_rel_error": statistics.median(errors[row]),
                       "argmax_right": sum(right[row]) / len(right[row])} for row in range(k + 1)]
        print(name, [(round(r["median_rel_error"], 5), round(r["max_rel_error"], 5), round(r["argmax_right"], 3))
                     for r in ways[name]], flush=True)
    step.checked, step.graphs = checked, graphs
    engine.close()
    args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "ways": ways}, indent=1))


if __name__ == "__main__":
    main()
