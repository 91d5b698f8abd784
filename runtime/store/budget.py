"""Memory budgets: parse "24GiB"-style strings and turn budgets into slot counts per tier.

A budget is what the user allows a tier in total. What the engine keeps resident there (dense
weights, KV, work buffers) is subtracted first; what is left is cut into record-sized slots. The
minimum is computed and named in the error: the device pool must hold one token's experts of the
layer being computed (top_k slots); the host tier must hold at least one read buffer.
Plain Python, no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flashpack.errors import FlashpackError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def parse_budget(text: str | int | None, flag: str = "budget") -> int | None:
    """ "24GiB", "512MiB", "1.5G", "4096", "0" -> bytes; None or "auto" -> None (no limit given)."""
    if text is None or isinstance(text, int):
        if isinstance(text, int) and text < 0:
            raise FlashpackError(f"{flag} must not be negative, got {text}")
        return text
    if text.strip().lower() in ("auto", ""):
        return None
    match = _BUDGET.match(text.lower())
    if not match or match.group(2) not in _UNITS:
        raise FlashpackError(f"cannot read {flag} {text!r}: write a size such as 24GiB, 512MiB, 1.5GB or 0")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def format_bytes(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"


@dataclass(frozen=True)
class StorePlan:
    """Slot counts of each tier, and the bytes they take."""

    record_stride: int
    device_slots: int
    host_slots: int  # pinned host cache, read buffers included
    device_reserved: int  # dense weights, KV, work buffers counted against the device budget
    host_reserved: int
    staging_slots: int = 0  # device rows after the slots: host records staged for a decode step

    @property
    def device_pool_bytes(self) -> int:
        return (self.device_slots + self.staging_slots) * self.record_stride

    @property
    def host_pool_bytes(self) -> int:
        return self.host_slots * self.record_stride


# top_k rows each: a layer's late staging, and its experts predicted by the layer before, in two sets
# that even and odd layers take turns with (runtime/experts.py, LATE_ROWS and ahead_rows)
STAGING_ROW_SETS = 3


def plan_store(
    *,
    record_stride: int,
    total_records: int,
    top_k: int,
    vram_budget: int | None,
    ram_budget: int | None,
    device_reserved: int = 0,
    host_reserved: int = 0,
    read_buffers: int = 1,
    staging: bool = False,
) -> StorePlan:
    """Slots per tier. A None budget means "room for every record" (nothing is ever evicted).

    The device pool needs top_k slots (one token's experts of the layer being computed), and with
    `staging` STAGING_ROW_SETS * top_k rows more, for a decode step to stage host records into
    (experts/HostRecords); the host tier needs `read_buffers` slots, the page-aligned buffers disk
    reads land in.
    """
    staging_slots = STAGING_ROW_SETS * top_k if staging else 0
    what = f"{top_k} expert slots (top_k of one layer)" + (f" and {staging_slots} staging rows" if staging else "")
    device_slots = _slots("--vram-budget", vram_budget, device_reserved, record_stride, top_k + staging_slots,
                          total_records + staging_slots, what) - staging_slots
    host_slots = _slots("--ram-budget", ram_budget, host_reserved, record_stride, read_buffers, total_records,
                        f"{read_buffers} read buffer(s)")
    return StorePlan(record_stride, device_slots, host_slots, device_reserved, host_reserved, staging_slots)


def _slots(flag: str, budget: int | None, reserved: int, stride: int, minimum: int, most: int, what: str) -> int:
    if budget is None:
        return max(most, minimum)
    needed = reserved + minimum * stride
    if budget < needed:
        raise FlashpackError(
            f"{flag} {format_bytes(budget)} is too small: the minimum is {format_bytes(needed)} "
            f"({format_bytes(reserved)} resident + {what} of {format_bytes(stride)})"
        )
    return min((budget - reserved) // stride, max(most, minimum))


def served_records(pack, layers: list[int] | None = None) -> list:
    """The pack's expert records of `layers` (None: of every layer), which a store holds."""
    records = pack.manifest.expert_records()
    if layers is None:
        return records
    wanted = set(layers)
    return [record for record in records if record.layer in wanted]
