"""The README's table from `flashpack bench` reports: one row per report, in the order given.

    python bench/table.py bench-unbounded.json bench-24g-64g.json ... [--json table.json]

Per row: the budget typed for the full model, the pack's layers and the count they are scaled to,
decode tok/s at that count (by layer kind), time to first token and prefill tok/s (scaled evenly),
and the decode roofline: which link bounds it and the fraction of its rate achieved.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _budget(typed: dict) -> str:
    if typed["vram"] is None and typed["ram"] is None:
        return "unbounded"
    return " / ".join("-" if typed[tier] is None else f"{typed[tier] / (1 << 30):g} GB" for tier in ("vram", "ram"))


def row(name: str, report: dict) -> dict:
    settings, ours = report["settings"], report["results"]["flashpack"]
    layers, target = settings["pack_layers"], report["budgets"]["layers_typed_for"]
    scaled = ours["scaled"] if target != layers else {"decode_tokens_per_s": ours["decode"]["tokens_per_s"],
                                                      "ttft_s": ours["prefill"]["ttft_s"]}
    roofline = report["roofline"].get(f"decode_at_{target}_layers") or report["roofline"]["decode"]
    prompt = settings["prompt_tokens"]
    return {
        "name": name, "budget": _budget(report["budgets"]["typed"]), "layers": layers, "scaled_to": target,
        "prompt_tokens": prompt, "decode_tok_s": scaled["decode_tokens_per_s"], "ttft_s": scaled["ttft_s"],
        "prefill_tok_s": prompt / scaled["ttft_s"], "bound": roofline["bound"],
        "achieved_over_roofline": roofline["achieved_over_roofline"],
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| run | budget | decode tok/s | TTFT s (prompt) | prefill tok/s | bound: achieved / roofline |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['budget']} | {r['decode_tok_s']:.1f} | {r['ttft_s']:.2f} ({r['prompt_tokens']}) "
                     f"| {r['prefill_tok_s']:.0f} | {r['bound']}: {r['achieved_over_roofline']:.2f} |")
    scale = {(r["layers"], r["scaled_to"]) for r in rows}
    lines.append("")
    lines.append("measured on " + ", ".join(f"{a} layers scaled to {b}" for a, b in sorted(scale)))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [row(path.stem.removeprefix("bench-"), json.loads(path.read_text())) for path in args.reports]
    print(markdown(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
