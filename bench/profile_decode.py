"""Where a decode step's time goes: torch.profiler over a few greedy steps of `flashpack`'s engine
(or, with `--phase prefill`, over one forward of the prompt; with `--phase verify`, over checked
speculative steps of `--verify-tokens` positions, each tracked and rewound to its first token as a
rejected draft leaves it; with `--phase extend`, over a follow-up's prefill: the prompt's state
restored, then `--extend-tokens` more tokens in one forward, checkpoints taken at `--marks`, as a
prompt-cache hit runs it).

    python bench/profile_decode.py PACK --device cuda [--vram-budget 24GiB --ram-budget 64GiB] --out DIR
    python bench/profile_decode.py PACK --vram-budget 24GiB --ram-budget 64GiB --emulate-layers 48 \
        --hot-set '*' --out DIR          # the budgets typed for 48 layers, scaled as `flashpack bench` does
    python bench/profile_decode.py PACK --phase prefill --prompt-len 32768 --out DIR
    python bench/profile_decode.py PACK --phase extend --prompt-len 32768 --extend-tokens 159 --marks 80 --out DIR
    python bench/profile_decode.py PACK --phase extend --fresh-extension ...   # new tokens each step (tiered budgets)

Writes DIR/profile-<name>.txt (top operators by host time and by device time) and prints the
step's wall time against the device-busy time (and `warm_steps_ms`, each unprofiled warm-up step's
wall time: the first ones pay for what is compiled or tuned on first use) (the sum of kernel and copy times): their gap is
host overhead (Python, launches, waits on the store). `host_split_ms` times, unprofiled, what a
decode step's host thread spends in the calls that matter for a tiered store (each call's wall
time per step, nested calls inside their callers); `--trace` also writes the profiled steps as a
gzipped Chrome trace (every thread, both streams), for chrome://tracing or Perfetto, and
`gpu_idle`: where the GPU waited, by what the host was doing (runtime/bench/gaps.py), and
`device_time_by_kernel_class`: the device's time by kind of kernel (runtime/bench/kernel_classes.py).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flashpack.layout.pack import Pack
from flashpack.runtime.bench.gaps import format_gaps, gpu_gaps, load_trace
from flashpack.runtime.bench.kernel_classes import format_classes, kernel_classes
from flashpack.runtime.bench.emulate import check_layers, scaled_budgets
from flashpack.runtime.bench.sizes import model_sizes
from flashpack.runtime.engine.build import load_engine, parse_device, parse_dtype
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.expert_paths import StoreExperts
from flashpack.runtime.engine.settings import with_settings
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.store.budget import parse_budget


@contextmanager
def timed_calls(targets: list[tuple[object, str]], totals: dict[str, float]):
    """Wrap each (object, method name): its wall time adds to totals["Class.method"] while inside."""
    saved = []
    for owner, name in targets:
        method = getattr(owner, name)

        def wrapper(*args, _method=method, _label=f"{type(owner).__name__}.{name}", **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                totals[_label] += time.perf_counter() - start

        saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, wrapper)
    try:
        yield totals
    finally:
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def host_targets(engine) -> list[tuple[object, str]]:
    model, store, graphs = engine.model, engine.store, engine.step.graphs
    # the PLE rows are hashed and gathered on the host before the first layer, which no device work hides
    targets = [(engine.step, "forward"), (model, "embed")] + [(layer.ple, "embed") for layer in model.layers
                                                         if layer.ple is not None]
    if graphs is not None:
        targets += [(graphs, name) for name in ("run", "_try_table", "_through_store") if hasattr(graphs, name)]
    targets += [(store, name) for name in ("hold_slot_table", "release_slot_table", "record_step")
                if store is not None and hasattr(store, name)]
    # a layer through the store: the MoE's whole call, and inside it the store's placing of a request,
    # its wait for the loads, and the next layer's prefetch (timed per layer and summed)
    if isinstance(model.experts, StoreExperts):
        targets.append((model.experts, "from_store"))
    targets += [(part, name) for part, name in ((getattr(store, "admission", None), "request"), (store, "_await"),
                                                (store, "prefetch")) if part is not None and hasattr(part, name)]
    return targets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pack")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vram-budget")
    parser.add_argument("--ram-budget")
    parser.add_argument("--emulate-layers", type=int, help="the layer count the budgets are typed for")
    parser.add_argument("--hot-set", help="pre-warm from this hot set ('*': every record the tiers hold)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--phase", choices=("decode", "prefill", "verify", "extend"), default="decode")
    parser.add_argument("--verify-tokens", type=int, default=5, help="positions of a checked step (--phase verify)")
    parser.add_argument("--extend-tokens", type=int, default=159, help="tokens after the prompt (--phase extend)")
    parser.add_argument("--marks", default="", help="checkpoints inside the extension, e.g. 80,150 (--phase extend)")
    parser.add_argument("--fresh-extension", action="store_true",
                        help="draw each step's extension anew (--phase extend): its tokens route to experts the "
                             "tiers' caches have not just been handed, as a follow-up's new tokens do; without it "
                             "every step repeats one extension, whose experts the first step leaves cached")
    parser.add_argument("--name", default="decode")
    parser.add_argument("--out", default=".")
    parser.add_argument("--trace", action="store_true", help="also write the profiled steps as a Chrome trace")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine setting by name, as `flashpack bench --set` takes it")
    args = parser.parse_args()
    manifest = Pack.open(args.pack).manifest
    device = parse_device(args.device)
    sizes = model_sizes(manifest, parse_dtype("auto", device), device)
    layers = manifest.config.num_hidden_layers
    typed = {"vram": parse_budget(args.vram_budget, "--vram-budget"),
             "ram": parse_budget(args.ram_budget, "--ram-budget")}
    _, budgets = scaled_budgets(typed, sizes.device_fixed, layers, check_layers(layers, args.emulate_layers))
    store = StoreConfig(vram_budget=budgets["vram"], ram_budget=budgets["ram"], hot_set=args.hot_set)
    engine = load_engine(args.pack, with_settings(EngineConfig(device=args.device, store=store, speculate="off"),
                                                  args.settings))
    forward, sync = engine.step.forward, (torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None))
    state = engine.step.new_state()
    prompt = torch.randint(0, 1000, (args.prompt_len,))
    token = int(forward(prompt, state, last_only=True).logits.argmax())
    if args.phase == "prefill":
        steps = 1

        def step():
            state.restore(engine.step.new_state())
            forward(prompt, state, last_only=True)
    elif args.phase == "extend":
        steps = args.steps
        prompt_state = state.snapshot()
        extension = torch.randint(0, 1000, (args.extend_tokens,))
        marks = [int(mark) for mark in args.marks.split(",") if mark]

        def step():
            nonlocal extension
            if args.fresh_extension:
                extension = torch.randint(0, manifest.config.vocab_size, (args.extend_tokens,))
            state.restore(prompt_state)
            forward(extension, state, last_only=True, marks=marks)
    elif args.phase == "verify":
        steps = args.steps

        def step():
            nonlocal token
            state.track()
            drafts = [(token + 1 + i) % 1000 for i in range(args.verify_tokens - 1)]
            token = int(forward(torch.tensor([token, *drafts]), state).logits[0].argmax())
            state.rewind(1)
    else:
        steps = args.steps

        def step():
            nonlocal token
            token = int(forward(torch.tensor([token]), state).logits.argmax())

    warm_steps = []
    for _ in range(steps):  # warm: kernels compiled, caches as decoding leaves them
        began = time.perf_counter()
        step()
        sync()
        warm_steps.append(round((time.perf_counter() - began) * 1e3, 2))
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    wall = (time.perf_counter() - start) / steps  # unprofiled: the profiler slows the host
    with timed_calls(host_targets(engine), defaultdict(float)) as totals:
        for _ in range(steps):
            step()
        sync()
    host_split = {name: round(seconds / steps * 1e3, 3) for name, seconds in totals.items()}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    events = prof.key_averages()
    device_busy = sum(e.self_device_time_total for e in events) / 1e6 / steps
    tables = [events.table(sort_by="self_cpu_time_total", row_limit=25),
              events.table(sort_by="self_device_time_total", row_limit=25)]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"profile-{args.name}.txt").write_text("\n\n".join(tables))
    idle = classes = None
    if args.trace:
        trace = Path(args.out, f"trace-{args.name}.json")
        prof.export_chrome_trace(str(trace))
        traced = load_trace(trace)
        idle, classes = gpu_gaps(traced, steps), kernel_classes(traced, steps)
        print(format_gaps(idle))
        print(format_classes(classes))
        with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        trace.unlink()
    summary = {"name": args.name, "step_wall_ms": wall * 1e3, "warm_steps_ms": warm_steps, "device_busy_ms": device_busy * 1e3,
               "host_overhead_ms": (wall - device_busy) * 1e3, "host_split_ms": host_split, "gpu_idle": idle,
               "device_time_by_kernel_class": classes,
               "phase": args.phase, "prompt_tokens": args.prompt_len, "fresh_extension": args.fresh_extension,
               "kernel_launches_per_step": sum(e.count for e in events if e.device_type.name == "CUDA") / steps}
    print(json.dumps(summary))
    Path(args.out, f"profile-{args.name}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
