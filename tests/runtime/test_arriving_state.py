"""A stored prompt state restored as it arrives (runtime/engine/arriving_state.py): the follow-up's
logits are those of a full prefill (FP32, CPU), with the disk's frames landing while the layers run;
restoring a layer before its bytes are in (the control) computes something else; an entry that
fails partway is dropped and the prompt prefilled afresh, its answer unchanged; a state reset while
its entry arrives lets the read go."""

from __future__ import annotations

import time

import pytest
import torch

from flashpack.runtime.engine import stored_states
from flashpack.runtime.engine.arriving_state import ArrivingState
from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.state_codec import encode_state, layer_ends
from flashpack.runtime.sampling import SamplingParams
from flashpack.runtime.state import SequenceState

FRAME_BYTES = 4096  # small frames: the tiny model's state is many of them, landing one by one


def _ids(count: int, seed: int) -> list[int]:
    return torch.randint(5, 1000, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def folder(tiny_pack, tmp_path, monkeypatch):
    """A stored-states folder holding the entries of one request's prompt (80 tokens) and reply."""
    monkeypatch.setattr(stored_states, "FRAME_BYTES", FRAME_BYTES)
    engine = load_engine(tiny_pack, _config(tmp_path))
    try:
        engine.generator.generate(_ids(80, 3), SamplingParams(max_tokens=4))
    finally:
        engine.close()
    return tmp_path


def _config(folder) -> EngineConfig:
    # nothing live: a follow-up restores from the disk, as after a restart
    return EngineConfig(device="cpu", dtype="float32", prompt_cache_ram="1KiB", prompt_cache_dir=str(folder),
                        speculate="off", restore_as_it_arrives=True)


def _follow_up(tiny_pack, folder, reuse: bool = True, whole: bool = False):
    """The follow-up (the prompt and 5 more tokens) on a fresh engine: its logits after the prompt,
    the result, and the prefix cache's stats. `whole`: a stored state read whole before the prefill
    (the restore the arriving one must equal: the same segments, 80 tokens restored then 5)."""
    engine = load_engine(tiny_pack, _config(folder))
    try:
        if not reuse:
            engine.generator.prefix_cache = None
        elif whole:
            engine.generator.prefix_cache._arrive_stored = lambda *args: None  # as with no room for it
        seen = []
        forward = engine.step.forward
        engine.step.forward = lambda tokens, state, **kwargs: seen.append(forward(tokens, state, **kwargs)) or seen[-1]
        result = engine.generator.generate(_ids(80, 3) + [11, 12, 13, 14, 15], SamplingParams(max_tokens=3))
        cache = engine.generator.prefix_cache
        return seen[0].logits[-1], result, None if cache is None else cache.to_dict()
    finally:
        engine.close()


def _slow_frames(monkeypatch, seconds: float = 0.02) -> None:
    """Each frame decompressed after a pause: the layers reach frames that have not landed yet."""
    decompress = stored_states._decompress_into

    def slow(frame, out):
        time.sleep(seconds)
        decompress(frame, out)

    monkeypatch.setattr(stored_states, "_decompress_into", slow)


def _restored_layers(monkeypatch) -> list[int]:
    """The layers restored from now on, in order, into any state."""
    restored = []
    restore_layer = SequenceState.restore_layer
    monkeypatch.setattr(SequenceState, "restore_layer",
                        lambda self, saved, layer: restored.append(layer) or restore_layer(self, saved, layer))
    return restored


def test_a_stored_hit_as_it_arrives_computes_what_a_full_prefill_does(tiny_pack, folder, monkeypatch):
    _slow_frames(monkeypatch)
    restored_layers = _restored_layers(monkeypatch)
    logits, result, stats = _follow_up(tiny_pack, folder)
    assert result.cached_tokens == 80 and stats["stored_hits"] == 1 and stats["stored"]["hits"] == 1
    assert restored_layers == sorted(restored_layers) and len(restored_layers) == len(set(restored_layers))
    whole_logits, whole, whole_stats = _follow_up(tiny_pack, folder, whole=True)
    assert whole.cached_tokens == 80 and whole_stats["stored_hits"] == 1
    assert torch.equal(logits, whole_logits) and result.token_ids == whole.token_ids
    assert stats["restore_seconds"] > 0  # the waits for bytes count as the restore's


def test_control_a_layer_restored_before_its_bytes_land_differs(tiny_pack, folder, monkeypatch):
    """Reading a layer's parts without waiting for them computes with bytes not yet there."""
    _slow_frames(monkeypatch, 0.05)
    whole_logits, _, _ = _follow_up(tiny_pack, folder, whole=True)

    def layer_without_waiting(self, layer):
        if self._ends.pop(layer, None) is not None:
            self.target.restore_layer(self.saved, layer)

    monkeypatch.setattr(ArrivingState, "layer", layer_without_waiting)
    logits, result, _ = _follow_up(tiny_pack, folder)
    assert result.cached_tokens == 80 and not torch.equal(logits, whole_logits)


def _corrupt_last_frame(folder) -> None:
    """Flip a byte of the largest entry's last frame (its checksum then fails: found only once
    every frame before it has been read, after the layers before it were restored)."""
    path = max(folder.rglob("*.fpstate"), key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def test_an_entry_failing_partway_is_dropped_and_the_prompt_prefilled_afresh(tiny_pack, folder, monkeypatch):
    plain_logits, plain, _ = _follow_up(tiny_pack, folder, reuse=False)
    for path in folder.rglob("*.fpstate"):  # the follow-up finds only the prompt's entry
        if not path.name.startswith("80-"):
            path.unlink()
    _corrupt_last_frame(folder)
    _slow_frames(monkeypatch)
    restored_layers = _restored_layers(monkeypatch)
    logits, result, stats = _follow_up(tiny_pack, folder)
    assert restored_layers  # it failed partway: some layers had been restored
    assert result.cached_tokens == 0 and result.token_ids == plain.token_ids and torch.equal(logits, plain_logits)
    assert stats["stored"]["dropped"] == 1 and stats["stored_hits"] == 0 and stats["misses"] >= 1
    assert not list(folder.rglob("80-*.fpstate"))


def test_a_state_reset_while_its_entry_arrives_lets_the_read_go(tiny_pack, folder, monkeypatch):
    _slow_frames(monkeypatch)
    engine = load_engine(tiny_pack, _config(folder))
    try:
        cache, state = engine.generator.prefix_cache, engine.step.new_state()
        assert cache.restore_longest(_ids(80, 3) + [11], state) == 80
        read = state.arriving.read
        state.restore(engine.step.new_state())  # what the next request's fresh state does
        assert state.arriving is None and state.position == 0 and not read._reader.is_alive()
        assert cache.stats.stored_hits == 0 and cache.stored.stats()["hits"] == 0
        assert list(folder.rglob("80-*.fpstate"))  # nothing wrong with the entry: it stays
    finally:
        engine.close()


def test_a_state_is_encoded_layer_by_layer(tiny_pack):
    engine = load_engine(tiny_pack, EngineConfig(device="cpu", dtype="float32", prompt_cache_ram=0))
    state = engine.step.new_state()
    engine.step.forward(torch.tensor(_ids(40, 1)), state)
    data = bytearray(b"".join(encode_state(state.snapshot())))
    ends = layer_ends(data)
    assert sorted(ends) == state.layers()
    assert [ends[layer] for layer in sorted(ends)] == sorted(ends.values())  # each layer's bytes after the last's
