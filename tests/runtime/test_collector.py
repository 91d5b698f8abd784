"""The garbage collector in a serving process (runtime/engine/collector.py): every pause timed, and
the heap frozen after the warm-up so that a full collection no longer walks the long-lived objects."""

from __future__ import annotations

import gc

from flashpack.runtime.engine.collector import CollectorPauses, Pauses, freeze_heap


def _cycles(count: int) -> list:
    """`count` objects the collector tracks, alive (each a list holding itself)."""
    kept = []
    for _ in range(count):
        item: list = []
        item.append(item)
        kept.append(item)
    return kept


def test_pauses_are_counted_by_generation_until_stopped():
    collector = CollectorPauses().start()
    try:
        before, mark = collector.pauses(), collector.mark()
        gc.collect(2)
        gc.collect(0)
        during = collector.pauses().since(before)
        assert during.counts[2] >= 1 and during.counts[0] >= 1
        assert during.seconds[2] > 0 and collector.longest_since(mark) > 0
        assert collector.longest_since(mark) == 0.0  # reading a mark ends it
    finally:
        collector.stop()
    stopped = collector.pauses()
    gc.collect(2)  # control: nothing is counted once stopped
    assert collector.pauses() == stopped


def test_a_mark_keeps_the_longest_pause_since_it_was_set():
    collector = CollectorPauses().start()
    try:
        kept = _cycles(200_000)
        gc.collect(2)  # a long walk before the mark
        first = collector.pauses().longest
        mark = collector.mark()
        del kept
        gc.collect(0)  # a short one after it
        assert 0 < collector.longest_since(mark) < first
    finally:
        collector.stop()


def test_a_frozen_heap_leaves_full_collections_only_what_came_since(tmp_path):
    kept = _cycles(100_000)
    try:
        assert len(gc.get_objects(2)) > 100_000 or len(gc.get_objects()) > 100_000
        seconds = freeze_heap()
        assert seconds > 0 and gc.get_freeze_count() > 100_000
        gc.collect()
        assert len(gc.get_objects(2)) < 50_000  # the frozen objects are out of the walk
        later = _cycles(1_000)
        gc.collect()
        assert 1_000 <= len(gc.get_objects(2)) < 50_000  # what came since is walked as before
        del later
    finally:
        gc.unfreeze()
    gc.collect()
    assert len(gc.get_objects(2)) > 100_000  # control: unfrozen, the kept objects are walked again
    del kept


def test_pauses_since_subtracts_counts_and_seconds():
    earlier = Pauses((5, 2, 1), (0.5, 0.2, 0.1), 0.1)
    later = Pauses((9, 3, 2), (0.9, 0.3, 0.4), 0.3)
    delta = later.since(earlier)
    assert delta.counts == (4, 1, 1) and [round(s, 6) for s in delta.seconds] == [0.4, 0.1, 0.3]
    assert delta.to_dict()["full_collections"] == 1 and delta.to_dict()["longest_seconds"] == 0.3
