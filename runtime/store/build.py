"""`build_store`: a TieredStore for a pack, from a StoreConfig (budgets, policy, hot set, ...) and a device.

What the engine keeps on the device besides experts (dense weights in the engine dtype, the
dequantised experts of one fetch, the KV the caller reserves) is counted against the device budget
before the pool is cut into slots; the pinned host cache gets the RAM budget. A budget too small
for one layer's top_k is refused here, at start, with the minimum in the message.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from flashpack.errors import FlashpackError
from flashpack.layout.manifest import Manifest
from flashpack.layout.pack import Pack
from flashpack.runtime.store.budget import StorePlan, parse_budget, plan_store, served_records
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.store.hotset import apply_hot_set
from flashpack.runtime.store.resident import ResidentExperts
from flashpack.runtime.store.store import TieredStore

ALL_RECORDS = "*"  # the hot set that pre-warms every record
_DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}


def dense_device_bytes(manifest: Manifest, width: int) -> dict[str, int]:
    """Bytes each dense tensor takes on the engine's device: projections stored as FP8 rows stay FP8
    (1 byte an element + a float32 scale a row, runtime/model/linear.py), the rest `width` bytes an element."""
    tensors = manifest.dense_tensors()
    scales = {t.row_scale for t in tensors.values() if t.row_scale}
    return {name: math.prod(t.shape) + 4 * t.shape[0] if t.row_scale else math.prod(t.shape) * width
            for name, t in tensors.items() if name not in scales}


def resident_device_bytes(
    manifest: Manifest, dtype: str | torch.dtype = "auto", kv_bytes: int = 0, device: str | torch.device = "cpu",
) -> int:
    """Bytes the engine holds on the device outside the expert pool: dense weights (FP8 rows stay
    FP8, the rest in `dtype`: `dense_device_bytes`), one fetch's dequantised experts
    (float32 today: top_k x 3 x H x I x 4), and `kv_bytes` the caller reserves for KV/state.
    dtype "auto" is the engine's: BF16 on a GPU, FP32 on a CPU."""
    if dtype == "auto":
        dtype = "bfloat16" if torch.device(device).type == "cuda" else "float32"
    if isinstance(dtype, torch.dtype):
        width = torch.empty((), dtype=dtype).element_size()
    else:
        width = _DTYPE_BYTES.get(dtype, 2)
    dense = sum(dense_device_bytes(manifest, width).values())
    cfg = manifest.config
    work = cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    return dense + work + kv_bytes


FREE_VRAM_SHARE, FREE_RAM_SHARE = 0.9, 0.75  # headroom for the allocator, activations, the OS


def machine_free_bytes(device: str | torch.device) -> tuple[int, int]:
    """Default budgets on a GPU: a share of the device's free memory and of the available RAM."""
    free_vram, _ = torch.cuda.mem_get_info(torch.device(device))
    available_ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free_vram * FREE_VRAM_SHARE), int(available_ram * FREE_RAM_SHARE)


def store_plan(
    pack: Pack, config: StoreConfig, device: str | torch.device, *, dtype: str | torch.dtype = "auto",
    kv_bytes: int = 0, device_reserved: int | None = None, host_reserved: int = 0, staging: bool = False,
    layers: list[int] | None = None,
) -> StorePlan:
    """The slots `build_store` gives each tier for these arguments (its docstring says how)."""
    manifest = pack.manifest
    if device_reserved is None:
        device_reserved = resident_device_bytes(manifest, dtype, kv_bytes, device)
    vram, ram = parse_budget(config.vram_budget), parse_budget(config.ram_budget)
    if torch.device(device).type == "cuda":  # no budget on a GPU: what the machine has free, not every record
        vram, ram = (free if given is None else given for given, free in zip((vram, ram), machine_free_bytes(device)))
    return plan_store(
        record_stride=manifest.document["experts"]["record_stride"],
        total_records=len(served_records(pack, layers)),
        top_k=manifest.config.num_experts_per_tok,
        vram_budget=vram,
        ram_budget=ram,
        device_reserved=device_reserved,
        host_reserved=host_reserved,
        staging=staging,
    )


def holds_every_record(plan: StorePlan, records: int) -> bool:
    """Whether a store of `plan` keeps `records` records without evicting any: all resident on the
    device, or all in the host cache."""
    return plan.device_slots + plan.staging_slots >= records or plan.host_slots >= records


def build_store(
    pack: Pack | Path | str,
    config: StoreConfig = StoreConfig(),
    device: str | torch.device = "cpu",
    *,
    dtype: str | torch.dtype = "auto",
    kv_bytes: int = 0,
    device_reserved: int | None = None,
    host_reserved: int = 0,
    poison: bool = False,
    allow_resident: bool = False,
    staging: bool = False,
    layers: list[int] | None = None,
) -> TieredStore | ResidentExperts:
    """A ready store for `config`'s budgets, policy, hot set, reader and copies. A budget of None is
    room for every record on a CPU, and on a GPU 90 % of its free memory and 75 % of the available
    RAM (`machine_free_bytes`).

    With `allow_resident` (the engine on a GPU), a device budget that holds every record gives a
    `ResidentExperts` instead: all records loaded once, slots looked up on the device. `staging`
    (CUDA-graph decode) sets STAGING_ROW_SETS * top_k rows of the device budget aside for decode
    steps to stage host records into (TabledSlots.host_records). `layers` limits the store to those
    layers' experts (the engine's decoder layers: the MTP head's experts take no room while nothing
    runs it).

    `device_reserved` overrides the estimate of what else lives on the device (see
    `resident_device_bytes`, from `dtype` and `kv_bytes`). `config.hot_set` names a profile in the
    manifest's hot_sets to pre-warm the device pool, then the host cache, from; `ALL_RECORDS` ("*")
    pre-warms every record, in expert order, as far as the two tiers hold them (what a machine
    whose RAM holds the experts reaches after a while of serving, at the price of reading the
    expert files once at start)."""
    pack = pack if isinstance(pack, Pack) else Pack.open(pack)
    manifest = pack.manifest
    records = served_records(pack, layers)
    profile = None
    if config.hot_set is not None and config.hot_set != ALL_RECORDS:
        profile = manifest.hot_sets.get(config.hot_set)
        if profile is None:
            names = ", ".join(sorted(manifest.hot_sets)) or "none; run `flashpack profile` first"
            raise FlashpackError(f"pack has no hot set {config.hot_set!r} (has: {names})")
    plan = store_plan(pack, config, device, dtype=dtype, kv_bytes=kv_bytes, device_reserved=device_reserved,
                      host_reserved=host_reserved, staging=staging, layers=layers)
    if allow_resident and plan.device_slots + plan.staging_slots >= len(records):
        return ResidentExperts(pack, device, config, plan=plan, layers=layers)
    store = TieredStore(pack, plan, config, device, poison=poison, layers=layers)
    if profile is not None:
        apply_hot_set(store, profile)
    elif config.hot_set == ALL_RECORDS:
        experts = manifest.config.num_experts
        store.prewarm({layer: list(range(experts)) for layer in store.layers})
    return store
