"""PackExperts' cache of dequantised experts: what it hands out equals a fresh decode, it stays
inside its bytes (least recently used dropped first), and 0 keeps nothing."""

from __future__ import annotations

import pytest
import torch

from flashpack.errors import FlashpackError
from flashpack.layout.pack import Pack
from flashpack.layout.records import PROJECTIONS
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.pack_source import PackExperts


def _expert_bytes(pack: Pack) -> int:
    weights = PackExperts(pack).fetch(0, [0])[0]
    return sum(getattr(weights, p).nbytes for p in PROJECTIONS)


def test_a_cached_expert_equals_a_fresh_decode_and_is_not_decoded_again(tiny_pack, monkeypatch):
    pack = Pack.open(tiny_pack)
    cached = PackExperts(pack, cache_bytes=1 << 30)
    first = cached.fetch(1, [0, 3])
    decodes = []
    real = pack.expert
    monkeypatch.setattr(pack, "expert", lambda *a, **k: decodes.append(a) or real(*a, **k))
    again = cached.fetch(1, [3, 0, 5])
    assert decodes == [(1, 5)]  # only the expert not fetched before
    fresh = PackExperts(Pack.open(tiny_pack)).fetch(1, [0, 3, 5])
    for expert in (0, 3, 5):
        for p in PROJECTIONS:
            assert torch.equal(getattr(again[expert], p), getattr(fresh[expert], p))
    assert again[0] is first[0]


def test_the_cache_keeps_within_its_bytes_dropping_the_least_recently_used(tiny_pack, monkeypatch):
    pack = Pack.open(tiny_pack)
    one = _expert_bytes(pack)
    cache = PackExperts(pack, cache_bytes=2 * one)
    cache.fetch(0, [0, 1])
    cache.fetch(0, [0])  # 0 is now the most recent: fetching 2 drops 1
    cache.fetch(0, [2])
    decodes = []
    real = pack.expert
    monkeypatch.setattr(pack, "expert", lambda *a, **k: decodes.append(a[:2]) or real(*a, **k))
    cache.fetch(0, [0, 2, 1])
    assert decodes == [(0, 1)]
    assert cache._held <= 2 * one


def test_no_bytes_decodes_on_every_fetch(tiny_pack, monkeypatch):
    pack = Pack.open(tiny_pack)
    cache = PackExperts(pack)
    decodes = []
    real = pack.expert
    monkeypatch.setattr(pack, "expert", lambda *a, **k: decodes.append(a[:2]) or real(*a, **k))
    cache.fetch(0, [4])
    cache.fetch(0, [4])
    assert decodes == [(0, 4), (0, 4)]


def test_the_setting_takes_a_size_and_refuses_others():
    assert EngineConfig(decoded_experts_ram="64MiB").decoded_experts_ram == "64MiB"
    EngineConfig(decoded_experts_ram=0)
    for bad in ("auto", "lots", -1):
        with pytest.raises(FlashpackError):
            EngineConfig(decoded_experts_ram=bad)
