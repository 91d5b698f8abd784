"""The verify report: one row per decoder layer plus the logits, an overall verdict, a table, JSON.

A row's numbers are the worst over every input sequence and both phases (prefill, decode); the
per-sequence, per-phase numbers are kept for the JSON report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from flashpack.verify.compare import Errors, LogitStats, worst
from flashpack.verify.inputs import Sequence

REPORT_VERSION = 1


@dataclass
class Row:
    name: str  # "layer 3" or "logits"
    kind: str  # linear_attention / indexed_attention (+ple), or "logits"
    phases: dict[str, dict[str, Errors]]  # sequence name -> phase ("prefill" / "decode") -> errors
    tolerance: float  # on the relative error
    floor: float | None = None  # BF16 only: transformers' own BF16 relative error here

    @property
    def errors(self) -> Errors:
        return worst(*(e for by_phase in self.phases.values() for e in by_phase.values()))

    @property
    def passed(self) -> bool:
        return self.errors.rel <= self.tolerance  # a NaN fails too

    def to_dict(self) -> dict:
        return {
            "name": self.name, "kind": self.kind, **self.errors.to_dict(), "tolerance": self.tolerance,
            "floor": self.floor, "passed": self.passed,
            "sequences": {
                seq: {phase: e.to_dict() for phase, e in by_phase.items()} for seq, by_phase in self.phases.items()
            },
        }


@dataclass
class VerifyReport:
    pack: str
    reference: str
    dtype: str
    device: str
    sequences: list[Sequence]
    rows: list[Row]  # decoder layers, then the logits
    logit_stats: LogitStats
    kl_gate: float  # KL mean must be at most this
    top1_gate: float  # top-1 agreement must be at least this
    control: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def logits_ok(self) -> bool:
        stats = self.logit_stats
        return stats.kl_mean <= self.kl_gate and stats.top1 >= self.top1_gate

    @property
    def passed(self) -> bool:
        return all(row.passed for row in self.rows) and self.logits_ok

    @property
    def verdict(self) -> str:
        if self.control is None:
            return "PASS" if self.passed else "FAIL"
        if self.passed:
            return f"PASS on control {self.control}: verify did NOT see this damage (the check is blind to it)"
        return f"FAIL on control {self.control}, as it must: verify catches this damage"

    def table(self) -> str:
        lines = [
            f"flashpack verify: {self.pack} against {self.reference} ({self.dtype}, {self.device}"
            + (f", control {self.control}" if self.control else "") + ")",
            "inputs: " + ", ".join(
                f"{s.name} ({len(s.prefill)} prefill + {len(s.decode)} decode)" for s in self.sequences
            ),
            "",
            f"{'':10} {'kind':22} {'max abs':>10} {'rel':>10} {'cos':>12} {'tol':>9}  ok",
        ]
        for row in self.rows:
            e = row.errors
            lines.append(
                f"{row.name:10} {row.kind:22} {e.max_abs:10.3e} {e.rel:10.3e} {e.cos:12.9f} {row.tolerance:9.2e}  "
                + ("yes" if row.passed else "NO")
            )
        stats = self.logit_stats
        lines += [
            "",
            f"logits: KL(ref||ours) mean {stats.kl_mean:.3e} (gate {self.kl_gate:.1e}), max {stats.kl_max:.3e}; "
            f"top-1 agreement {stats.top1:.4f} (gate {self.top1_gate:.3f}) over {stats.positions} positions",
            f"verdict: {self.verdict}",
        ]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "report_version": REPORT_VERSION,
            "passed": self.passed,
            "verdict": self.verdict,
            "pack": self.pack,
            "reference": self.reference,
            "dtype": self.dtype,
            "device": self.device,
            "control": self.control,
            "gates": {"kl_mean": self.kl_gate, "top1": self.top1_gate},  # rel gates are per row
            "inputs": [
                {"name": s.name, "prefill_tokens": len(s.prefill), "decode_tokens": len(s.decode)}
                for s in self.sequences
            ],
            "layers": [row.to_dict() for row in self.rows if row.kind != "logits"],
            "logits": {
                **self.rows[-1].to_dict(), **self.logit_stats.to_dict(),
                "passed": self.rows[-1].passed and self.logits_ok,
            },
            "seconds": self.seconds,
        }

    def write_json(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))
