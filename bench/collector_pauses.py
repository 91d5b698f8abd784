"""How long a full garbage collection takes in a warmed engine's process, and what requests meet.

    python bench/collector_pauses.py [PACK] [--device cuda] --json OUT

Without PACK, a tiny NVFP4 model is synthesised and converted in a temporary folder (its compiled
graphs are as many as a real pack's: one set a layer kind). The engine is loaded with
`freeze_heap=false` and warmed up; then the heap's size and one full collection's seconds, twenty
requests of mixed lengths (greedy, 8 tokens, speculation as the engine's default) with the
collections each met (all, full ones, the longest pause), one full collection again, and the same
after `freeze_heap` (runtime/engine/collector.py). On a GPU the requests also take the checked
steps' first captures at each attention cache size they grow to.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.collector import freeze_heap
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.sampling import SamplingParams

LENGTHS = [300, 3000, 80, 1200, 300, 3900, 90, 2000, 300, 100] * 2


def tiny_pack(folder: Path) -> Path:
    from flashpack.convert.pipeline import convert
    from flashpack.convert.synth import synthesize

    snapshot = synthesize("tiny", folder / "snapshot", format="nvfp4", seed=0)
    return convert(str(snapshot), folder / "tiny.pack", progress=False)


def full_collection() -> float:
    start = time.perf_counter()
    gc.collect()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pack", nargs="?", help="a pack (default: a tiny synthetic one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    report: dict = {"device": args.device}
    with tempfile.TemporaryDirectory() as folder:
        pack = args.pack or tiny_pack(Path(folder))
        engine = load_engine(pack, EngineConfig(device=args.device, freeze_heap=False))
        report["objects_after_load"] = len(gc.get_objects())
        before = engine.collector.pauses()
        start = time.perf_counter()
        engine.warm_up()
        report["warm_up_s"] = time.perf_counter() - start
        report["warm_up_collections"] = engine.collector.pauses().since(before).to_dict()
        report["objects_after_warm_up"] = len(gc.get_objects())
        rows = []
        limit = (engine.generator.max_context or engine.model_config.max_position_embeddings) - 16
        for number, length in enumerate(LENGTHS):
            ids = [(7 * j + number) % 900 + 5 for j in range(min(length, limit))]
            before, mark = engine.collector.pauses(), engine.collector.mark()
            start = time.perf_counter()
            engine.generator.generate(ids, SamplingParams(max_tokens=8))
            met = engine.collector.pauses().since(before)
            rows.append({"tokens": len(ids), "seconds": time.perf_counter() - start, "gc_s": sum(met.seconds),
                         "full_collections": met.counts[2], "longest_s": engine.collector.longest_since(mark)})
            print(json.dumps(rows[-1]), flush=True)
        report["requests"] = rows
        report["objects_before_collection"] = len(gc.get_objects())
        report["full_collection_s"] = [full_collection(), full_collection()]
        report["freeze_s"] = freeze_heap()
        report["frozen_objects"] = gc.get_freeze_count()
        report["full_collection_frozen_s"] = [full_collection(), full_collection()]
        engine.close()
    args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "requests"}, indent=1))


if __name__ == "__main__":
    main()
