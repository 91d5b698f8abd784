"""StoreConfig: every setting of the tiered expert store, with its default and why.

The CLI's flags (--vram-budget, --ram-budget, --policy, --hot-set, --no-direct-io,
--no-verify-records) and `bench --set store.KEY=VALUE` build one; `build_store` takes it. Nothing
else sets the store's behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashpack.errors import FlashpackError
from flashpack.runtime.store.budget import parse_budget
from flashpack.runtime.store.policy import DEFAULT_POLICY, POLICIES


@dataclass(frozen=True)
class StoreConfig:
    # Device expert pool, e.g. "24GiB" or bytes. None: on a GPU 90 % of its free memory, on a CPU
    # room for every record.
    vram_budget: str | int | None = None
    # Pinned host cache. None: on a GPU 75 % of the available RAM, on a CPU room for every record.
    ram_budget: str | int | None = None
    # Eviction policy of both tiers (runtime/store/policy.py): lfu keeps the experts a workload
    # comes back to; lru and lfu-decay follow a workload that shifts.
    policy: str = DEFAULT_POLICY
    # A profile in the manifest's hot_sets to pre-warm the tiers from, "*" for every record.
    hot_set: str | None = None
    # Read records with O_DIRECT (the page cache would hold a second copy of what the host cache
    # holds); off for filesystems that refuse it.
    direct_io: bool = True
    # Check each record's xxh64 as it is read from the pack.
    verify_records: bool = True
    # Threads reading records from disk: NVMe drives need several reads in flight to reach their rate.
    reader_threads: int = 8
    # Parts a single record's read is split into, so one large record keeps several of the drive's
    # queues busy.
    read_pieces: int = 4
    # A decode layer's host-cache copies are enqueued by the calling thread (True) or handed to the
    # copy thread (False): enqueued at once, they land before the layer's experts are asked for.
    copy_on_requesting_thread: bool = True
    # A prefetch read may start beside a required read already running: a guess held back lands
    # after the layer that wants it asks.
    guesses_beside_required: bool = True
    # Move a staged expert that outranks its victim into a device slot. Off: the copies and their
    # bookkeeping cost more than the hits they buy (bench/results/README.md).
    promote: bool = False
    # Move slots between layers as their demand shifts.
    rebalance: bool = True

    def __post_init__(self) -> None:
        parse_budget(self.vram_budget, "vram_budget")
        parse_budget(self.ram_budget, "ram_budget")
        if self.policy not in POLICIES:
            raise FlashpackError(f"unknown eviction policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        for name in ("reader_threads", "read_pieces"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise FlashpackError(f"store {name} must be a whole number of at least 1, got {value!r}")
