"""bench/prompt_step.py: each variant's engine times its steps in alternated rounds (A/B/A/B), one row
a variant, round and length, and the JSON and table are written."""

from __future__ import annotations

import json

from flashpack.bench.prompt_step import main


def test_the_variants_alternate_round_by_round(tiny_pack, tmp_path):
    out = tmp_path / "step.json"
    main([str(tiny_pack), "--variant", "base=", "--variant", "cublas=dense_tile_max_tokens=0", "--context", "40",
          "--new", "5", "--new", "20", "--repeats", "2", "--steps", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    order = [(row["round"], row["variant"], row["new_tokens"]) for row in report["rows"]]
    assert order == [(r, v, n) for r in (1, 2) for v in ("base", "cublas") for n in (5, 20)]
    assert report["variants"] == {"base": [], "cublas": ["dense_tile_max_tokens=0"]}
    assert all(row["step_s"] > 0 for row in report["rows"])
    assert "| cublas | dense_tile_max_tokens=0 | 2 | 20 |" in out.with_suffix(".md").read_text()
