"""The real drafters on the trained demo model: prompt lookup's and the MTP head's acceptance and
what they buy, on held-out code, on prose-like text and on an edit task.

    python bench/drafters_demo.py [--device cpu] [--prompts 4] [--tokens 96] --json bench/results/drafters-demo-cpu.json

Tasks, from the corpus' held-out files (transformers sources the model never trained on):
    code    a file's first 256 tokens, continued
    prose   a docstring's first half (English prose about code), continued
    edit    "the same function with the variable X renamed to Y" (bench/demo_model/edit_tasks.py):
            the function is in the prompt, the continuation rewrites it
Each task's prompts are decoded greedily `--tokens` tokens (or to an end of text) with every draft
checked (lookup alone, the MTP head alone; the policy off, so acceptance is measured on every
step), and as `--speculate auto` runs it (lookup, then the MTP head, the policy on), each
alternated with plain decoding `--repeats` times (medians; stats are the decoder's over all its runs). Every
speculative output is checked to equal the plain one. Reported per task and drafter: acceptance
per draft position, tokens a checked step, decode tokens a second and the speed-up over plain on
this machine. Writes JSON and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import tempfile
from pathlib import Path

from flashpack import demo_model
from flashpack.bench.demo_model.edit_tasks import edit_tasks
from flashpack.bench.demo_model.held_out import TextModel, file_prompts
from flashpack.convert.pipeline import convert
from flashpack.convert.train.corpus import load_corpus
from flashpack.runtime.bench.machine import machine_info
from flashpack.runtime.engine.build import load_engine, parse_device
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.drafters import LookupDrafter
from flashpack.runtime.engine.settings import with_settings
from flashpack.runtime.engine.speculative import SpeculativeDecoder
from flashpack.runtime.sampling import SamplingParams


def prose_prompts(text: TextModel, files, count: int) -> list[tuple[str, list[int]]]:
    """The first half of the first long docstring of each file, as many as `count`."""
    found = []
    for source in files:
        try:
            tree = ast.parse(source.text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node) or ""
                if len(doc) > 400:
                    found.append((source.path, text.encode(doc[:len(doc) // 2])))
                    break
        if len(found) == count:
            break
    return found


def task_prompts(text: TextModel, corpus, count: int) -> dict[str, list[tuple[str, list[int]]]]:
    return {
        "code": file_prompts(text, corpus.held_out, count, 256),
        "prose": prose_prompts(text, corpus.held_out, count),
        "edit": [(task.path, text.encode(task.prompt)) for task in edit_tasks(corpus.held_out, count)],
    }


def run(engine, prompts, tokens: int, decoder) -> tuple[list[list[int]], float, dict | None]:
    """Each prompt decoded with `decoder` (None: plainly): (outputs, decode seconds, its stats)."""
    engine.generator.speculation = decoder
    outputs, seconds = [], 0.0
    for _, ids in prompts:
        result = engine.generator.generate(ids, SamplingParams(max_tokens=tokens))
        outputs.append(result.token_ids)
        seconds += result.total_seconds - result.first_token_seconds
    engine.generator.speculation = None
    return outputs, seconds, None if decoder is None else decoder.stats.to_dict()


def _chosen(text: str, known, option: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise SystemExit(f"{option}: choose from {', '.join(known)}; got {text!r}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pack", help="the demo model's pack (default: converted into a temporary folder)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=4, help="prompts a task")
    parser.add_argument("--tokens", type=int, default=96, help="tokens decoded a prompt at most")
    parser.add_argument("--repeats", type=int, default=2, help="alternated plain and speculative runs of each "
                        "(medians; the decoder and its policy carry over between them)")
    parser.add_argument("--tasks", default="code,prose,edit", help="which tasks, comma-separated (default %(default)s)")
    parser.add_argument("--drafters", default="lookup,mtp,auto", help="which drafters, comma-separated (default %(default)s)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine setting by name, as `flashpack bench --set` takes it")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="drafters-") as work:
        pack = args.pack or convert(str(demo_model.snapshot_path()), Path(work) / "demo.pack", progress=False)
        config = with_settings(EngineConfig(device=args.device, prompt_cache_ram=0, speculate="auto"), args.settings)
        engine = load_engine(pack, config)
        lookup, mtp = engine.generator.speculation.drafters
        text = TextModel.load(demo_model.snapshot_path())
        tasks = task_prompts(text, load_corpus(max_train_files=0), args.prompts)
        tasks = {task: tasks[task] for task in _chosen(args.tasks, tasks, "--tasks")}
        wanted = _chosen(args.drafters, ("lookup", "mtp", "auto"), "--drafters")
        run(engine, next(iter(tasks.values()))[:1], 16, None)  # warm-up
        rows = []
        for task, prompts in tasks.items():
            for name, drafters, policy in (("lookup", [LookupDrafter()], False), ("mtp", [mtp], False),
                                           ("auto", [LookupDrafter(), mtp], True)):
                if name not in wanted:
                    continue
                decoder = SpeculativeDecoder(engine.step, drafters, engine.config.draft_tokens, policy=policy)
                plain_times, times, lossless = [], [], True
                for _ in range(args.repeats):  # alternated: plain, speculative, plain, ...
                    plain, plain_seconds, _ = run(engine, prompts, args.tokens, None)
                    outputs, seconds, stats = run(engine, prompts, args.tokens, decoder)
                    plain_times.append(plain_seconds)
                    times.append(seconds)
                    lossless = lossless and outputs == plain
                generated = sum(len(output) - 1 for output in plain)
                plain_seconds, seconds = statistics.median(plain_times), statistics.median(times)
                rows.append({
                    "task": task, "drafter": name, "policy": policy, "prompts": len(prompts),
                    "decoded_tokens": generated, "lossless": lossless, "repeats": args.repeats,
                    "acceptance": stats["acceptance"], "acceptance_at": stats["acceptance_at"],
                    "tokens_per_step": stats["tokens_per_step"], "checked_steps": stats["steps"],
                    "plain_steps": stats["plain_steps"], "by_drafter": stats["by_drafter"],
                    "tokens_per_s": generated / seconds, "plain_tokens_per_s": generated / plain_seconds,
                    "speedup": plain_seconds / seconds, "speedups": [p / t for p, t in zip(plain_times, times)],
                })
                print(f"{task} {name}: acceptance {stats['acceptance']:.2f}, {stats['tokens_per_step']:.2f} tokens a "
                      f"step, {rows[-1]['speedup']:.2f}x, lossless {rows[-1]['lossless']}", flush=True)
        engine.close()
    report = {"machine": machine_info(parse_device(args.device)), "settings": {**vars(args), "json": str(args.json)},
              "runs": rows,
              "notes": ["acceptance: accepted drafts over drafted ones; acceptance_at[i]: of the checked steps with a "
                        "draft at position i, the share that accepted it",
                        "speedup: plain decode seconds over speculative ones, same prompts, same machine"]}
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    lines = ["| task | drafter | policy | acceptance | by position | tokens/checked step | tok/s | plain tok/s | speed-up | lossless |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        positions = " ".join(f"{a:.2f}" for a in row["acceptance_at"])
        lines.append(f"| {row['task']} | {row['drafter']} | {'on' if row['policy'] else 'off'} | {row['acceptance']:.2f} "
                     f"| {positions} | {row['tokens_per_step']:.2f} | {row['tokens_per_s']:.1f} "
                     f"| {row['plain_tokens_per_s']:.1f} | {row['speedup']:.2f}x | {row['lossless']} |")
    table = (f"demo model, {args.device}, {args.prompts} prompts a task, up to {args.tokens} tokens each, "
             f"{args.repeats} alternated repeats (medians)\n\n") + "\n".join(lines) + "\n"
    args.json.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
