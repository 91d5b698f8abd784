"""Converter benchmark: throughput (GB/s written) and peak RSS converting a `full`-dims snapshot.

    python bench/convert.py --layers 2 --workdir /tmp/fp-bench --json bench/results/convert-<machine>.json

Synthesises `full --layers N` (PLE shrunk to fit the disk) in BF16 and NVFP4, converts each in a
fresh process (so ru_maxrss is the convert's own peak), and reports bytes written, seconds, GB/s
and peak RSS next to the size of what was written: the bound that matters is RSS << output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


_PEAK_RSS = (
    "import runpy, sys\n"
    "sys.argv = ['flashpack'] + sys.argv[1:]\n"
    "try:\n    runpy.run_module('flashpack.cli', run_name='__main__')\n"
    "finally:\n    print('VmHWM', [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])"
)


def _run_child(args: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of one `flashpack` command in a fresh process.

    VmHWM is the high-water mark of the child's own address space; ru_maxrss would also count
    the parent's pages that the child held between fork and exec."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", _PEAK_RSS, *args], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"flashpack {' '.join(args)} failed:\n{result.stderr[-2000:]}")
    peak_kib = int(result.stdout.rsplit("VmHWM", 1)[1].split()[0])
    return seconds, peak_kib * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ple-rows-per-head", type=int, default=200_000)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/flashpack-bench"))
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--formats", default="bf16,nvfp4")
    args = parser.parse_args()
    flashpack: list[str] = []
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for weight_format in args.formats.split(","):
        snapshot = args.workdir / f"full-{args.layers}-{weight_format}"
        pack = args.workdir / f"full-{args.layers}-{weight_format}.pack"
        shutil.rmtree(snapshot, ignore_errors=True)
        shutil.rmtree(pack, ignore_errors=True)
        synth_seconds, synth_rss = _run_child(flashpack + [
            "synth", "full", str(snapshot), "--format", weight_format, "--layers", str(args.layers),
            "--ple-rows-per-head", str(args.ple_rows_per_head),
        ])
        convert_seconds, convert_rss = _run_child(flashpack + ["convert", str(snapshot), str(pack), "--quiet"])
        written, read = _tree_bytes(pack), _tree_bytes(snapshot)
        rows.append({
            "source_format": weight_format, "layers": args.layers, "snapshot_bytes": read, "pack_bytes": written,
            "convert_seconds": round(convert_seconds, 2), "written_gb_per_s": round(written / convert_seconds / 1e9, 3),
            "read_gb_per_s": round(read / convert_seconds / 1e9, 3), "peak_rss_bytes": convert_rss,
            "peak_rss_over_pack": round(convert_rss / written, 4), "synth_seconds": round(synth_seconds, 2),
        })
        shutil.rmtree(snapshot, ignore_errors=True)
        shutil.rmtree(pack, ignore_errors=True)
    result = {
        "machine": {"node": platform.node(), "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "python": platform.python_version()},
        "settings": {"preset": "full", "layers": args.layers, "ple_rows_per_head": args.ple_rows_per_head},
        "results": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"{'source':<7} {'pack GB':>8} {'seconds':>8} {'GB/s written':>13} {'peak RSS GB':>12} {'RSS/pack':>9}")
    for row in rows:
        print(f"{row['source_format']:<7} {row['pack_bytes'] / 1e9:8.2f} {row['convert_seconds']:8.1f} "
              f"{row['written_gb_per_s']:13.3f} {row['peak_rss_bytes'] / 1e9:12.2f} {row['peak_rss_over_pack']:9.3f}")


if __name__ == "__main__":
    main()
