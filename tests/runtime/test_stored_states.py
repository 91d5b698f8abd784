"""Stored prompt states (runtime/engine/stored_states.py, state_codec.py): a state survives a
restart exactly and continues to the same logits; a truncated, corrupted, foreign, old-format or
misnamed entry is never used (dropped, its file removed, None returned); the disk budget removes the
oldest entries and nothing else; writes happen on the writer thread."""

from __future__ import annotations

import threading

import pytest
import torch

from flashpack.errors import FlashpackError
from flashpack.runtime.engine import stored_states
from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.state_codec import StateFormatError, decode_state, encode_state
from flashpack.runtime.engine.stored_states import StoredStates
from flashpack.runtime.state import SequenceState


@pytest.fixture(scope="module")
def engine(tiny_pack):
    return load_engine(tiny_pack, EngineConfig(dtype="float32", prompt_cache_ram=0))


def _state(engine, tokens: int, seed: int = 0) -> SequenceState:
    state = engine.step.new_state()
    ids = torch.randint(5, 1000, (tokens,), generator=torch.Generator().manual_seed(seed))
    engine.step.forward(ids, state)
    return state


def _equal(a: SequenceState, b: SequenceState) -> bool:
    same = a.position == b.position
    same &= all(torch.equal(x.conv, b.deltanet[l].conv) and torch.equal(x.recurrent, b.deltanet[l].recurrent)
                for l, x in a.deltanet.items())
    same &= all(torch.equal(x.context, b.ple[l].context) and torch.equal(x.conv, b.ple[l].conv) for l, x in a.ple.items())
    for layer, cache in a.attention.items():
        other = b.attention[layer]
        same &= (cache.length, cache.blocks) == (other.length, other.blocks)
        same &= all(torch.equal(x, y) for x, y in zip((cache.keys, cache.values, cache.index_keys, cache.block_keys),
                                                      (other.keys, other.values, other.index_keys, other.block_keys)))
    return bool(same)


def _encoded(state: SequenceState) -> bytearray:
    return bytearray(b"".join(encode_state(state)))


def test_a_state_round_trips_exactly(engine):
    state = _state(engine, 70)
    assert _equal(decode_state(_encoded(state), engine.step.new_state()), state)


def test_the_encoding_is_safetensors_and_copies_no_tensor(engine):
    """safetensors' own reader (the library, not ours) finds every tensor and the metadata; the pieces
    after the header are the snapshot's tensors' own bytes, not copies (a copy would be made holding
    the GIL, stalling the request thread while the writer encodes)."""
    from safetensors.torch import load

    state = _state(engine, 70).snapshot()
    pieces = encode_state(state)
    loaded = load(bytes(b"".join(pieces)))
    assert torch.equal(loaded["deltanet.0.recurrent"], state.deltanet[0].recurrent)
    layer = next(iter(state.attention))
    assert torch.equal(loaded[f"attention.{layer}.keys"], state.attention[layer].keys)
    assert sum(t.numel() > 0 for t in loaded.values()) == len(pieces) - 1  # an empty tensor has no bytes
    pointers = {torch.frombuffer(piece, dtype=torch.uint8).data_ptr() for piece in pieces[1:]}
    assert all(t.data_ptr() in pointers for part in state.deltanet.values() for t in (part.conv, part.recurrent))


def test_a_tensor_whose_shape_does_not_fit_its_bytes_is_refused(engine):
    """The tensors are read as views of the decompressed bytes, each checked against its bytes."""
    import json

    data = _encoded(_state(engine, 70))
    header_bytes = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8:8 + header_bytes]))
    name = next(key for key in header if key.startswith("attention."))
    header[name]["shape"][-1] *= 2  # more elements than its bytes
    text = json.dumps(header, separators=(",", ":")).encode().ljust(header_bytes)
    assert len(text) == header_bytes
    data[8:8 + header_bytes] = text
    with pytest.raises(StateFormatError, match="not a stored state"):
        decode_state(data, engine.step.new_state())


def test_a_state_missing_a_part_is_refused(engine):
    state = _state(engine, 70)
    state.ple = {}
    with pytest.raises(StateFormatError, match="parts differ"):
        decode_state(_encoded(state), engine.step.new_state())
    with pytest.raises(StateFormatError, match="not a stored state"):
        decode_state(bytearray(b"not safetensors at all"), engine.step.new_state())


def test_an_entry_survives_a_restart_and_continues_to_the_same_logits(engine, tmp_path):
    state = _state(engine, 70)
    first = StoredStates(tmp_path, 1 << 30, "pack-a")
    first.put("70-abc", 70, state.snapshot())
    first.close()
    again = StoredStates(tmp_path, 1 << 30, "pack-a")
    restored = again.get("70-abc", engine.step.new_state())
    assert restored is not None and _equal(restored, state)
    follow = torch.tensor([7, 8, 9])
    fresh = engine.step.new_state()
    fresh.restore(restored)
    assert torch.equal(engine.step.forward(follow, fresh).logits, engine.step.forward(follow, state).logits)
    assert again.stats()["hits"] == 1 and again.keys() == ["70-abc"]


def test_an_entry_read_into_a_given_buffer_stays_there_as_views_and_continues_alike(engine, tmp_path):
    """What a GPU's prefix cache does with its pinned arena: the frames decompress into the buffer,
    and the state is made of views of it on the host, attention caches exactly their filled parts."""
    import numpy as np

    state = _state(engine, 70)
    stored = StoredStates(tmp_path, 1 << 30, "pack-a")
    stored.put("70-abc", 70, state.snapshot())
    stored.flush()
    buffers = []

    def buffer(nbytes):
        buffers.append(np.full(nbytes, 0xFF, dtype=np.uint8))  # poisoned: a byte not written reads as NaN
        return buffers[-1]

    restored = stored.get("70-abc", engine.step.new_state(), buffer=buffer)
    assert restored is not None and _equal(restored, state) and len(buffers) == 1
    start, end = buffers[0].ctypes.data, buffers[0].ctypes.data + buffers[0].nbytes
    for tensor in restored.device_tensors():
        assert tensor.numel() == 0 or start <= tensor.data_ptr() < end
    assert all(cache.capacity == cache.length for cache in restored.attention.values())
    follow = torch.tensor([7, 8, 9])
    fresh = engine.step.new_state()
    fresh.restore(restored)
    assert torch.equal(engine.step.forward(follow, fresh).logits, engine.step.forward(follow, state).logits)
    # no room in the buffer's owner: read as without one
    assert _equal(stored.get("70-abc", engine.step.new_state(), buffer=lambda nbytes: None), restored)
    stored.close()


def _damaged(path, kind: str) -> None:
    data = bytearray(path.read_bytes())
    if kind == "truncated":
        del data[len(data) // 2:]
    elif kind == "flipped":
        data[-10] ^= 0x40
    elif kind == "old-format":
        data[4] = 0
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["truncated", "flipped", "old-format", "foreign", "misnamed"])
def test_control_a_damaged_or_foreign_entry_is_dropped_never_used(engine, tmp_path, kind):
    stored = StoredStates(tmp_path, 1 << 30, "pack-a")
    stored.put("70-abc", 70, _state(engine, 70))
    stored.flush()
    path = tmp_path / "70-abc.fpstate"
    if kind == "foreign":
        stored = StoredStates(tmp_path, 1 << 30, "pack-b")
    elif kind == "misnamed":
        path = path.rename(tmp_path / "70-def.fpstate")
    else:
        _damaged(path, kind)
    key = "70-def" if kind == "misnamed" else "70-abc"
    assert stored.get(key, engine.step.new_state()) is None
    assert not path.exists() and stored.stats()["dropped"] == 1
    assert stored.get(key, engine.step.new_state()) is None and stored.stats()["misses"] == 1  # gone: a miss


def test_the_disk_budget_removes_the_oldest_entries_and_nothing_else(engine, tmp_path):
    import os

    mine = tmp_path / "notes.txt"
    mine.write_text("a user's file")
    state = _state(engine, 70)
    probe = StoredStates(tmp_path / "probe", 1 << 30, "p")
    probe.put("1-a", 70, state)
    probe.close()
    size = (tmp_path / "probe" / "1-a.fpstate").stat().st_size
    stored = StoredStates(tmp_path, int(2.5 * size), "p")
    for number in range(4):
        stored.put(f"{number}-a", 70, state)
        stored.flush()
        os.utime(tmp_path / f"{number}-a.fpstate", (number + 1, number + 1))  # a clock that moves on
    assert sorted(stored.keys()) == ["2-a", "3-a"] and mine.read_text() == "a user's file"


def test_writes_happen_on_the_writer_thread(engine, tmp_path, monkeypatch):
    gate = threading.Event()
    real = StoredStates._write

    def held(self, *args):
        gate.wait(10)
        real(self, *args)

    monkeypatch.setattr(StoredStates, "_write", held)
    stored = StoredStates(tmp_path, 1 << 30, "p")
    stored.put("70-abc", 70, _state(engine, 70))
    assert not (tmp_path / "70-abc.fpstate").exists()  # put returned with the write still to do
    gate.set()
    stored.flush()
    assert (tmp_path / "70-abc.fpstate").exists() and stored.stats()["writes"] == 1
    assert not list(tmp_path.glob(".*partial*"))


def test_puts_beyond_the_pending_bytes_are_dropped_while_the_disk_is_behind(engine, tmp_path, monkeypatch):
    gate = threading.Event()
    real = StoredStates._write
    monkeypatch.setattr(StoredStates, "_write", lambda self, *args: (gate.wait(10), real(self, *args)))
    state = _state(engine, 70)
    monkeypatch.setattr(stored_states, "PENDING_BYTES", int(1.5 * state.nbytes()))
    stored = StoredStates(tmp_path, 1 << 30, "p")
    for number in range(3):
        stored.put(f"{number}-a", 70, state)
    gate.set()
    stored.flush()
    assert stored.stats()["writes"] == 1 and stored.stats()["skipped_writes"] == 2


def test_a_folder_that_cannot_be_written_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(FlashpackError, match="cannot keep prompt states in"):
        StoredStates(blocker / "states", 1 << 30, "p")


def test_a_restarted_engine_restores_from_stored_states(tiny_pack, tmp_path):
    """End to end: one engine saves a conversation's states to disk; a new one, with nothing live,
    restores the longest and reports the tokens it did not prefill."""
    from flashpack.runtime.sampling import SamplingParams

    config = EngineConfig(dtype="float32", prompt_cache_ram="256MiB", prompt_cache_dir=str(tmp_path))
    prompt = torch.randint(5, 1000, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    first = load_engine(tiny_pack, config)
    reply = first.generator.generate(prompt, SamplingParams(max_tokens=4))
    first.close()
    second = load_engine(tiny_pack, config)
    follow_up = prompt + reply.token_ids[:-1] + [11, 12, 13]
    result = second.generator.generate(follow_up, SamplingParams(max_tokens=2))
    assert result.cached_tokens == len(prompt) + len(reply.token_ids) - 1
    assert second.generator.prefix_cache.to_dict()["stored_hits"] == 1
    second.close()
    assert stored_states.SUFFIX == ".fpstate" and list(tmp_path.rglob("*.fpstate"))


def test_a_lookup_reads_only_its_own_prefixes_entries(engine, tmp_path, monkeypatch):
    """Other prompts' entries of the lengths a prompt could restore are never opened (each would be
    a failed open and a stored miss: thousands in a long-running server's folder), nor is a stray
    file; the prompt's own entry is. Control: an entry of this prompt's prefix is read and restored."""
    from flashpack.runtime.engine.prefix_cache import PrefixCache

    stored = StoredStates(tmp_path, 1 << 30, "pack")
    cache = PrefixCache(ram_budget=0, stored=stored)  # nothing live: every hit comes from the disk
    ids = lambda seed: torch.randint(5, 1000, (40,), generator=torch.Generator().manual_seed(seed)).tolist()  # noqa: E731
    for seed in range(4):  # four other prompts' entries of lengths 10-40
        other = ids(10 + seed)
        cache.save(other[:10 * (seed + 1)], _state(engine, 10 * (seed + 1), seed))
    mine = ids(1)
    cache.save(mine[:20], _state(engine, 20, 7))
    stored.flush()
    (tmp_path / "notes.fpstate").write_bytes(b"a user's file")
    opened = []
    for name in ("get", "arriving"):  # read whole, or as it arrives
        real = getattr(stored, name)
        monkeypatch.setattr(stored, name, lambda key, *args, real=real, **kwargs: opened.append(key) or real(key, *args, **kwargs))
    state = engine.step.new_state()
    assert cache.restore_longest(mine + [3, 4], state) == 20
    state.arrive_all()
    assert len(opened) == 1 and opened[0].startswith("20-") and stored.stats()["misses"] == 0
    assert _equal(state, _state(engine, 20, 7))
    assert (tmp_path / "notes.fpstate").exists()
    stored.close()


def test_strided_parts_are_encoded_as_torch_would_copy_them():
    """The codec copies an attention cache's filled part (strided) with numpy, off torch's thread
    pool: the bytes are torch's own contiguous copy's, for every dtype a state holds."""
    from flashpack.runtime.engine.state_codec import _contiguous_on_host

    for dtype in (torch.bfloat16, torch.float32, torch.int64):
        whole = (torch.randn(4, 64, 16) * 100).to(dtype)
        part = whole[:, :37]
        copied = _contiguous_on_host(part)
        assert copied.is_contiguous() and copied.dtype == dtype and torch.equal(copied, part.contiguous())


@pytest.mark.parametrize("damage", [None, "middle-frame", "frame-lengths"])
def test_an_entry_of_many_frames_round_trips_and_a_damaged_frame_drops_it(engine, tmp_path, damage):
    """Frames are compressed and checked each on its own (decoded on a pool as they are read): an entry
    of many is exact; a flipped bit in one frame, or a header whose frame lengths lie, drops it."""
    import json

    state = _state(engine, 70)
    stored = StoredStates(tmp_path, 1 << 30, "p", frame_bytes=4096)
    stored.put("70-abc", 70, state)
    stored.flush()
    path = tmp_path / "70-abc.fpstate"
    data = bytearray(path.read_bytes())
    _, _, length = stored_states._PREFIX.unpack_from(data)
    start = stored_states._PREFIX.size
    header = json.loads(data[start:start + length])
    assert len(header["frames"]) > 3
    if damage == "middle-frame":
        middle = start + length + sum(size for size, _, _ in header["frames"][:2]) + 5
        data[middle] ^= 0x10
    elif damage == "frame-lengths":  # the same total, cut elsewhere: every frame then fails its checksum
        header["frames"][0][0] += 1
        header["frames"][1][0] -= 1
        text = json.dumps(header).encode()
        data[:start + length] = stored_states._PREFIX.pack(stored_states.MAGIC, stored_states.FORMAT, len(text)) + text
    path.write_bytes(bytes(data))
    restored = stored.get("70-abc", engine.step.new_state())
    if damage is None:
        assert restored is not None and _equal(restored, state)
    else:
        assert restored is None and not path.exists() and stored.stats()["dropped"] == 1
    stored.close()
