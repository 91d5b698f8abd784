"""The speculation policy's choices at given step times, simulated: no model runs, only the policy.

    python bench/policy_simulation.py --plain-ms 2.5 --checked-ms 2:3.6,3:4.3,4:5.0,5:5.6 \
        [--alphas 0.5,0.7,0.9] [--draft-tokens 4] [--gen 128] [--decodes 3] [--seeds 200] --json OUT

A SpeculativeDecoder with the engine's policy (runtime/engine/speculative.py) decodes `--decodes`
requests of `--gen` tokens in a row, as the engine's one decoder serves its requests, on a simulated
clock: a plain step takes `--plain-ms`, a checked step of T positions `--checked-ms`[T], and its
drafter proposes k tokens each right with probability alpha, as the replay drafter of
runtime/bench/speculation.py does. Per alpha, over `--seeds` seeds: the speed-up over plain decoding
with every draft checked and with the policy deciding (median and 10th percentile over the seeds,
every decode's time), and the share of tokens the policy chose by checked steps. The step times
come from a measured run (the defaults: the H200's 16-layer checked steps at 3 and 5 tokens and a
plain one, README's speculation figures, the others interpolated): what the policy makes of steps
that cost this much, not a measurement of any engine. Writes JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from flashpack.runtime.engine.speculative import SpeculativeDecoder


class SimulatedClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ReplayLike:
    """Proposes k tokens; the simulation, not the tokens, decides how many are right."""
    name, cheap = "replay", False

    def start(self, prompt_ids) -> None:
        pass

    def extend(self, tokens) -> None:
        pass

    def observe(self, tokens, streams, state, marked=()) -> None:
        pass

    def propose(self, token, state, k: int) -> list[int]:
        return [0] * k


def simulate(plain_ms: float, checked_ms: dict[int, float], alpha: float, k: int, gen: int, decodes: int,
             seed: int, policy: bool) -> tuple[float, int]:
    """(simulated seconds of `decodes` decodes of `gen` tokens, tokens chosen by checked steps)."""
    rng, clock = random.Random(seed), SimulatedClock()
    decoder = SpeculativeDecoder(step=None, drafters=[ReplayLike()], draft_tokens=k, policy=policy, clock=clock)
    by_checked = 0
    for _ in range(decodes):
        decoder.start([0])
        chosen = 1  # the prompt's step chose the first
        while chosen < gen:
            draft = decoder.draft(0, None, gen - chosen)
            if draft is None:
                clock.now += plain_ms / 1e3
                chosen += 1
                continue
            accepted = 0
            while accepted < len(draft.tokens) and rng.random() < alpha:
                accepted += 1
            clock.now += checked_ms[len(draft.tokens) + 1] / 1e3
            decoder.checked(draft, accepted)
            by_checked += min(accepted + 1, gen - chosen)  # a last step may choose one past the request
            chosen += accepted + 1
    return clock.now, by_checked


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plain-ms", type=float, default=2.5)
    parser.add_argument("--checked-ms", default="2:3.6,3:4.3,4:5.0,5:5.6",
                        help="T:ms for each checked step length T (2 .. k + 1)")
    parser.add_argument("--alphas", default="0.5,0.7,0.9")
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--decodes", type=int, default=3, help="requests one decoder serves in a row")
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        checked_ms = {int(t): float(ms) for t, ms in (item.split(":") for item in args.checked_ms.split(","))}
        alphas = [float(a) for a in args.alphas.split(",")]
    except ValueError:
        raise SystemExit(f"--checked-ms takes T:ms pairs (e.g. 2:3.6,3:4.3) and --alphas numbers (e.g. 0.5,0.9): "
                         f"got {args.checked_ms!r} and {args.alphas!r}") from None
    if not all(0.0 <= alpha <= 1.0 for alpha in alphas) or args.plain_ms <= 0 or min(checked_ms.values()) <= 0:
        raise SystemExit("alphas lie in 0..1 and step times are positive")
    missing = sorted(set(range(2, args.draft_tokens + 2)) - set(checked_ms))
    if missing:
        raise SystemExit(f"--checked-ms needs a time for every step length 2 .. {args.draft_tokens + 1}: missing {missing}")
    plain_seconds = args.decodes * (args.gen - 1) * args.plain_ms / 1e3
    rows = []
    for alpha in alphas:
        found = {}
        for policy in (False, True):
            runs = [simulate(args.plain_ms, checked_ms, alpha, args.draft_tokens, args.gen, args.decodes, seed, policy)
                    for seed in range(args.seeds)]
            speedups = [plain_seconds / seconds for seconds, _ in runs]
            found[policy] = {"median": statistics.median(speedups), "p10": percentile(speedups, 0.1),
                             "checked_share": statistics.mean(t for _, t in runs) / (args.decodes * (args.gen - 1))}
        rows.append({"alpha": alpha, "every_draft_checked": found[False], "policy": found[True]})
    report = {"settings": vars(args) | {"json": str(args.json)}, "rows": rows,
              "notes": ["speed-up: plain decoding's simulated seconds over the run's, every decode of a seed "
                        "together; median and 10th percentile over the seeds",
                        "checked_share: tokens chosen by checked steps over all tokens chosen after the first"]}
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    table = ["| alpha | every draft checked (p10) | policy (p10) | policy's tokens by checked steps |",
             "| --- | --- | --- | --- |"]
    for row in rows:
        every, chosen = row["every_draft_checked"], row["policy"]
        table.append(f"| {row['alpha']} | {every['median']:.2f}x ({every['p10']:.2f}x) | {chosen['median']:.2f}x "
                     f"({chosen['p10']:.2f}x) | {chosen['checked_share']:.0%} |")
    args.json.with_suffix(".md").write_text(
        f"# The speculation policy, simulated\n\nplain step {args.plain_ms} ms, checked steps {checked_ms} ms, "
        f"k {args.draft_tokens}, {args.decodes} decodes of {args.gen} tokens a seed, {args.seeds} seeds\n\n"
        + "\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
