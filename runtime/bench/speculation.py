"""Speculative decoding at controlled acceptance: plain greedy decode against checked steps whose
drafts a replay drafter makes right with probability alpha per position.

    python -m flashpack.runtime.bench.speculation PACK --device cuda [--vram-budget 24GiB --ram-budget 64GiB]
        [--emulate-layers 48] [--hot-set '*'] [--alphas 0.5,0.7,0.9] [--draft-tokens 1,2,3,4] --json OUT

One engine (budgets typed for the full model, scaled to the pack's layers as `flashpack bench`
does) decodes GEN tokens greedily after a PROMPT-token prompt, one token a step: the plain time and
the true continuation. Then for each alpha and k, the same decode with a ReplayDrafter that
proposes, for each of the k positions independently, the true next token with probability alpha
and a wrong one otherwise (every SpeculativeDecoder step checked, the policy off), and the output
is checked to equal the plain one. Then each alpha once more with the policy on (the largest k): what
`--speculate` would do, which must never be much slower than plain; one decoder serves those
repeats, as the engine's serves its requests, and the first repeat, which pays for trying, is
reported apart. Per run: seconds, tokens a
step, the speed-up, and the experts a checked step's union needed per layer (counted in an
untimed pass, since observing the routing reads it back). Through a tiered store what the tiers hold
depends on what ran before (a decode's misses, what it promoted): there each timed decode, plain or
speculative, follows the same untimed plain decode, so every one starts from the store that pass
leaves, and a speculative decode is not timed against a plain one on another store's state. Figures at 48 layers scale the time in
the layers: t(48) = t + (t - t_fixed) * (48 - L) / L, t_fixed the embedding and lm_head of each
step's positions, timed alone. Writes JSON and a markdown table. The warm-up (the plain decode,
then each step length's checked graphs) ends by freezing the heap, as Engine.warm_up does
(EngineConfig.freeze_heap).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from flashpack.layout.pack import Pack
from flashpack.runtime.bench.clock import median_seconds, synchronize
from flashpack.runtime.bench.emulate import scaled_budgets
from flashpack.runtime.bench.machine import machine_info
from flashpack.runtime.bench.sizes import model_sizes
from flashpack.runtime.bench.workload import prompt_ids
from flashpack.runtime.engine.build import load_engine, parse_device, parse_dtype
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.settings import with_settings
from flashpack.runtime.engine.speculative import PLAIN, SpeculativeDecoder
from flashpack.runtime.sampling import Sampler, SamplingParams
from flashpack.runtime.store.budget import parse_budget
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.store.store import TieredStore


class ReplayDrafter:
    """Proposes the known greedy continuation `truth`, each position right with probability
    `alpha` (seeded), else a token that is certainly wrong."""
    name = "replay"
    cheap = False  # it stands in for the MTP head, whose proposals cost a layer's work each

    def __init__(self, truth: list[int], prompt_length: int, alpha: float, vocab: int, seed: int = 0):
        self.truth, self.prompt_length, self.alpha, self.vocab = truth, prompt_length, alpha, vocab
        self.random = random.Random(seed)
        self.length = 0
        self.divergences = 0  # times the output left the truth and the truth was decoded again

    def start(self, prompt_ids) -> None:
        self.length = len(prompt_ids)

    def follow(self, truth: list[int]) -> None:
        self.truth, self.divergences = truth, self.divergences + 1

    def extend(self, tokens) -> None:
        self.length += len(tokens)

    def observe(self, tokens, streams, state, marked=()) -> None:
        pass

    def propose(self, token: int, state, k: int) -> list[int]:
        ahead = self.truth[self.length - self.prompt_length:][:k]  # what follows `token`
        return [t if self.random.random() < self.alpha else (t + 1) % self.vocab for t in ahead]


def decode(engine, state, prompt: list[int], gen: int, decoder: SpeculativeDecoder | None,
           replay: "ReplayDrafter | None" = None, trace: list[dict] | None = None) -> tuple[list[int], float]:
    """Prefill `prompt`, then greedy decode until `gen` tokens are chosen: (the tokens, decode seconds).
    With `replay`, where the output leaves the replayed truth (in BF16 a checked step rounds otherwise
    than one-token steps, and a near-tie can fall the other way), the truth from there on is decoded
    again plainly from the current state, untimed, so that its drafts stay right with probability alpha.
    `trace`: each step appended as it went (`step_record`), where a policy's choices are to be read."""
    step, device = engine.step, engine.model.device
    state.restore(step.new_state())
    greedy = Sampler(SamplingParams(), device=device)
    if decoder is not None:
        decoder.start(prompt)
    out = step.forward(torch.tensor(prompt), state, last_only=True)
    if decoder is not None:
        decoder.observe(prompt, out.streams, state)
    tokens = [int(out.logits[-1].argmax())]
    synchronize(device)
    start, untimed = time.perf_counter(), 0.0
    while len(tokens) < gen:
        token, began_step, untimed_before, chosen_before = tokens[-1], time.perf_counter(), untimed, len(tokens)
        draft = decoder.draft(token, state, gen - len(tokens)) if decoder is not None else None
        if draft is not None:
            accepted, following = decoder.verify(token, draft, state, greedy)
            tokens += [*accepted, following]
        else:
            out = step.forward(torch.tensor([token]), state, last_only=True)
            if decoder is not None:
                decoder.observe([token], out.streams, state)
            tokens.append(int(out.logits[-1].argmax()))
        if replay is not None and tokens[:len(replay.truth)] != replay.truth[:len(tokens)]:
            began = time.perf_counter()
            replay.follow(plain_continuation(step, state, tokens, gen + decoder.draft_tokens))
            untimed += time.perf_counter() - began
            decoder.exclude(time.perf_counter() - began)  # nor is it the policy's
        if trace is not None:
            trace.append(step_record(decoder, replay, draft is not None, len(tokens) - chosen_before,
                                     time.perf_counter() - began_step - (untimed - untimed_before)))
    synchronize(device)
    return tokens[:gen], time.perf_counter() - start - untimed


def step_record(decoder: SpeculativeDecoder, replay: "ReplayDrafter | None", checked: bool, tokens: int,
                seconds: float) -> dict:
    """One step of a traced decode: its kind, the tokens it chose, its seconds (a divergence's
    untimed decode left out), and what the policy judged by as it was chosen (the step before
    judged: each step is judged when the next one is chosen) and the tokens it still rests."""
    record = {"checked": checked, "tokens": tokens, "ms": round(seconds * 1e3, 3)}
    if replay is not None:
        drafter, plain = decoder.pace(replay.name), decoder.pace(PLAIN)
        record.update(resting=drafter["resting"], divergences=replay.divergences,
                      **{f"{kind}_median_ms": None if pace["seconds"] is None else round(pace["seconds"] * 1e3, 3)
                         for kind, pace in (("checked", drafter), ("plain", plain))},
                      checked_mean_tokens=drafter["tokens"])
    return record


def rests(trace: list[dict]) -> list[dict]:
    """The steps at which the drafter began to rest: where a policy turned speculation off, with
    what it judged by just before (a rest forgets the drafter's yields)."""
    found = []
    for index, record in enumerate(trace):
        if record.get("resting") and (index == 0 or not trace[index - 1].get("resting")):
            before = trace[index - 1] if index else record
            found.append({"step": index, "resting": record["resting"],
                          **{name: before.get(name) for name in ("checked_median_ms", "checked_mean_tokens",
                                                                  "plain_median_ms")}})
    return found


def plain_continuation(step, state, tokens: list[int], until: int) -> list[int]:
    """`tokens` (the last one not yet consumed by `state`) continued greedily one token a step to
    `until` tokens; `state` is left as it was."""
    saved, tokens = state.snapshot(), list(tokens)
    while len(tokens) < until:
        tokens.append(int(step.forward(torch.tensor(tokens[-1:]), state, last_only=True).logits[-1].argmax()))
    state.restore(saved)
    return tokens


def speculative_decode(engine, prompt: list[int], gen: int, repeats: int) -> dict:
    """Decode `gen` tokens after `prompt` `repeats` times with the engine's own drafters and policy,
    beside as many plain decodes (alternated): what `flashpack bench --speculate` reports."""
    decoder = engine.generator.speculation
    state = engine.step.new_state()
    state.reserve(len(prompt) + gen + decoder.draft_tokens + 2)
    truth, _ = decode(engine, state, prompt, gen, None)
    plain, checked, lossless = [], [], True
    for _ in range(repeats):
        plain.append(decode(engine, state, prompt, gen, None)[1])
        tokens, seconds = decode(engine, state, prompt, gen, decoder)
        checked.append(seconds)
        lossless = lossless and tokens == truth
    stats = decoder.stats.to_dict()
    return {"drafters": [d.name for d in decoder.drafters], "plain_seconds": statistics.median(plain),
            "seconds": statistics.median(checked), "tokens_per_s": (gen - 1) / statistics.median(checked),
            "speedup": statistics.median(plain) / statistics.median(checked), "lossless": lossless, "stats": stats}


def union_experts(engine, state, prompt, gen, decoder) -> float | None:
    """Mean experts a checked step's layer needed (the union of its positions' picks), untimed."""
    sizes = []

    def observer(layer, ids):
        if ids.shape[0] > 1 and ids.shape[0] <= decoder.draft_tokens + 1:
            sizes.append(int(ids.unique().numel()))

    engine.model.observe_routing(observer)
    checked, engine.step.checked = engine.step.checked, None  # graphs run none of the observing code
    try:
        decode(engine, state, prompt, gen, decoder)
    finally:
        engine.model.observe_routing(None)
        engine.step.checked = checked
    return statistics.mean(sizes) if sizes else None


TIMED_PARTS = ("draft_seconds", "verify_seconds", "rollback_seconds")  # SpeculationStats' clocks


def fixed_step_seconds(model, positions: int) -> float:
    """Embedding and lm_head of a step of `positions` tokens, timed alone."""
    tokens = torch.zeros(positions, dtype=torch.long, device=model.device)
    return median_seconds(lambda: model.logits(model.embed(tokens).repeat(1, model.config.hc_count)), model.device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pack")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vram-budget")
    parser.add_argument("--ram-budget")
    parser.add_argument("--hot-set", help="pre-warm the tiers from this profile ('*': every record)")
    parser.add_argument("--emulate-layers", type=int, help="the full model's decoder layers, for budgets and scaling")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--alphas", default="0.5,0.7,0.9")
    parser.add_argument("--draft-tokens", default="1,2,3,4")
    parser.add_argument("--repeats", type=int, default=2, help="timed decodes of each setting, plain ones between "
                        "(with the policy one more first, reported apart)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine setting by name, as `flashpack bench --set` takes it")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    alphas = [float(a) for a in args.alphas.split(",")]
    ks = [int(k) for k in args.draft_tokens.split(",")]

    pack = Pack.open(args.pack)
    cfg = pack.manifest.config
    device = parse_device(args.device)
    layers, target = cfg.num_hidden_layers, args.emulate_layers or cfg.num_hidden_layers
    typed = {"vram": parse_budget(args.vram_budget, "--vram-budget"), "ram": parse_budget(args.ram_budget, "--ram-budget")}
    sizes = model_sizes(pack.manifest, parse_dtype("auto", device), device)
    _, budgets = scaled_budgets(typed, sizes.device_fixed, layers, target)
    store = StoreConfig(vram_budget=budgets["vram"], ram_budget=budgets["ram"], hot_set=args.hot_set)
    config = with_settings(EngineConfig(device=args.device, experts="store" if device.type == "cuda" else "auto",
                                        store=store, prompt_cache_ram=0, speculate="off"), args.settings)
    engine = load_engine(args.pack, config)
    eos = cfg.eos_token_id if cfg.eos_token_id is not None and cfg.eos_token_id >= 0 else None
    prompt = prompt_ids(engine.tokenizer.tokenizer, cfg.vocab_size, args.prompt_len, args.seed, eos)
    state = engine.step.new_state()
    state.reserve(args.prompt_len + args.gen + max(ks) + 2)

    def replay(alpha: float, k: int, policy: bool = False) -> SpeculativeDecoder:
        drafter = ReplayDrafter(truth, args.prompt_len, alpha, cfg.vocab_size, args.seed)
        return SpeculativeDecoder(engine.step, [drafter], k, policy=policy)

    truth, _ = decode(engine, state, prompt, args.gen, None)  # warm-up: kernels, graphs, store
    for k in range(1, max(ks) + 1):  # every step length a timed decode meets, 2 .. k + 1 (its last steps
        # have fewer tokens left), twice: a checked step's graphs run eagerly first and are captured
        # the second time (captured_call.py), which must not be timed
        decode(engine, state, prompt, 2 * k + 3, replay(1.0, k))
    engine.freeze_heap()  # as Engine.warm_up ends: what the warm-up built stays out of later collections
    plain_runs = []
    tiered = isinstance(engine.store, TieredStore)

    def settled() -> None:
        """The untimed plain decode each timed one follows through a tiered store (module docstring)."""
        if tiered:
            decode(engine, state, prompt, args.gen, None)

    def plain() -> float:
        settled()
        tokens, seconds = decode(engine, state, prompt, args.gen, None)
        if tokens != truth:
            raise SystemExit("plain greedy decode differs between runs")
        plain_runs.append(seconds)
        return seconds

    def scaled(seconds: float, steps: dict[int, int]) -> float:
        fixed = sum(count * fixed_seconds[positions] for positions, count in steps.items())
        return seconds + (seconds - fixed) * (target - layers) / layers

    fixed_seconds = {positions: fixed_step_seconds(engine.model, positions) for positions in {1, *(k + 1 for k in ks)}}
    rows = []
    settings = [(alpha, k, False) for alpha in alphas for k in ks] + [(alpha, max(ks), True) for alpha in alphas]
    for alpha, k, policy in settings:
        # with the policy, one decoder serves every repeat, as the engine's does its requests: the
        # first pays for trying, the others know (the first is reported apart)
        times, counts, spent, stats, lossless, divergences, traces = [], [], [], None, True, 0, []
        shared = replay(alpha, k, policy=True) if policy else None
        for repeat in range(args.repeats + policy):
            plain()
            decoder = shared or replay(alpha, k)
            drafter = decoder.drafters[0]
            drafter.truth, before = truth, drafter.divergences  # each repeat from the plain output
            stats = decoder.stats
            steps_before = (stats.steps, stats.plain_steps)  # the shared decoder's stats run on over repeats
            seconds_before = {name: getattr(stats, name) for name in TIMED_PARTS}
            settled()
            trace = [] if policy else None  # where the policy chose what
            tokens, seconds = decode(engine, state, prompt, args.gen, decoder, replay=drafter, trace=trace)
            if policy:
                traces.append(trace)
            times.append(seconds)
            counts.append((stats.steps - steps_before[0], stats.plain_steps - steps_before[1]))
            spent.append({name: getattr(stats, name) - seconds_before[name] for name in TIMED_PARTS})
            lossless = lossless and tokens == truth
            divergences += drafter.divergences - before
        first_seconds = None
        if policy:  # the policy's first decode, which pays for trying, is reported apart
            first_seconds = times.pop(0)
            counts.pop(0)
            spent.pop(0)
        plain_seconds = statistics.median(plain_runs[-len(times):])
        seconds = statistics.median(times)
        summary = stats.to_dict()
        # one timed decode's steps (the mean over the repeats), scaled with that decode's seconds
        steps = {k + 1: statistics.mean(c for c, _ in counts), 1: statistics.mean(p for _, p in counts)}
        rows.append({
            "alpha": alpha, "k": k, "policy": policy, "seconds": seconds, "plain_seconds": plain_seconds,
            "speedup": plain_seconds / seconds, "lossless": lossless, "divergences": divergences,
            "first_request_speedup": None if first_seconds is None else plain_seconds / first_seconds,
            "tokens_per_step": summary["tokens_per_step"], "checked_steps": steps[k + 1], "plain_steps": steps[1],
            "acceptance_at": summary["acceptance_at"],
            "speedup_scaled": scaled(plain_seconds, {1: args.gen - 1}) / scaled(seconds, steps),
            "union_experts": None if policy else union_experts(engine, state, prompt, min(args.gen, 16), replay(alpha, k)),
            # one timed decode's (the mean over the repeats), as the steps are
            **{name: statistics.mean(part[name] for part in spent) for name in TIMED_PARTS},
        })
        if policy:  # each decode's steps (the first one's first), and where the drafter began to rest
            rows[-1].update(steps=traces, rests=[rests(trace) for trace in traces])
            for number, began in enumerate(rows[-1]["rests"]):
                print(f"  decode {number}: rests began at steps " + (", ".join(
                    f"{r['step']} (checked median {r['checked_median_ms']} ms for {r['checked_mean_tokens']} tokens, "
                    f"plain {r['plain_median_ms']} ms, rest {r['resting']})" for r in began) or "none"), flush=True)
        print(f"alpha {alpha} k {k} policy {policy}: {rows[-1]['speedup']:.2f}x ({rows[-1]['speedup_scaled']:.2f}x at "
              f"{target} layers), {rows[-1]['tokens_per_step']:.2f} tokens a step, lossless {lossless} ({divergences} divergences)", flush=True)
    engine.close()
    report = {
        "machine": machine_info(device),
        "settings": {**{name: value for name, value in vars(args).items() if name != "json"}, "json": str(args.json),
                     "pack_layers": layers, "budgets_scaled": budgets, "expert_source": type(engine.store).__name__,
                     "settled": tiered,
                     "cuda_graphs": engine.step.graphs is not None},
        "plain": {"seconds": statistics.median(plain_runs), "tokens_per_s": (args.gen - 1) / statistics.median(plain_runs),
                  "tokens_per_s_scaled": (args.gen - 1) / scaled(statistics.median(plain_runs), {1: args.gen - 1})},
        "fixed_step_seconds": fixed_seconds,
        "runs": rows,
        "notes": ["speedup: plain decode seconds over speculative, medians of alternated repeats",
                  f"scaled: t({target}) = t + (t - t_fixed) * ({target} - {layers}) / {layers}",
                  "union_experts: mean distinct experts per layer of a checked step (top-k of each position)",
                  "draft_seconds, verify_seconds, rollback_seconds: one timed decode's (the mean over the repeats, "
                  "the policy's first decode left out, as for checked_steps and plain_steps); the table's ms a "
                  "checked step: verify_seconds / checked_steps",
                  "settled: through a tiered store each timed decode followed the same untimed plain decode",
                  "lossless: every repeat's output equals plain decoding's; divergences: times over the repeats an "
                  "output left the plain one (a BF16 near-tie), after which the replayed truth was decoded again "
                  "plainly from there, untimed",
                  "steps (policy rows): each decode's steps, the first decode's first: checked or plain, tokens "
                  "chosen, ms (a divergence's untimed decode left out), and the policy's median step times, mean yield and the tokens the "
                  "drafter still rests as the step was chosen (a step is judged when the next is chosen); rests: "
                  "the steps at which a rest began"],
    }
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    table = ["| alpha | k | policy | tokens/step | speed-up | at %d layers | ms a checked step | union experts/layer "
             "| lossless (divergences) |" % target, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        union = "" if row["union_experts"] is None else f"{row['union_experts']:.1f}"
        step_ms = f"{1e3 * row['verify_seconds'] / row['checked_steps']:.2f}" if row["checked_steps"] else ""
        table.append(f"| {row['alpha']} | {row['k']} | {'on' if row['policy'] else 'off'} | {row['tokens_per_step']:.2f} "
                     f"| {row['speedup']:.2f}x | {row['speedup_scaled']:.2f}x | {step_ms} | {union} "
                     f"| {row['lossless']} ({row['divergences']}) |")
    plain_row = report["plain"]
    text = (f"plain: {plain_row['tokens_per_s']:.1f} tok/s ({plain_row['tokens_per_s_scaled']:.1f} at {target} layers), "
            f"{type(engine.store).__name__}, budgets {args.vram_budget or 'none'} / {args.ram_budget or 'none'}\n\n"
            + "\n".join(table) + "\n")
    args.json.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
