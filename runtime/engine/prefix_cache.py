"""Prompt-state reuse: sequence states at checkpoints of token sequences, found again by prefix.

A checkpoint is the whole SequenceState after a sequence's first L tokens (DeltaNet recurrent and
conv states, QSA keys and indexer keys, PLE n-gram context and conv tails, the position): the
hybrid model's DeltaNet state exists only where it was saved, not per token, so reuse restores a
saved point exactly and prefills what follows it. Generation saves one at the end of each prompt,
at the chat template's message boundaries (the prompt is prefilled in those segments, so a
follow-up that edits only its last message still restores everything before it) and at the end
of each reply.

An entry is keyed by its length and the xxh64 of its tokens (int64, little-endian). Lookup hashes
the prompt once, in order, taking the digest at each length an entry has, and restores the longest
entry that leaves at least one token to prefill (whose logits the next token is sampled from).

Live entries are compact host copies under a byte budget, least recently used evicted first. On
a GPU they are pinned, so a restore is one fast copy per tensor, in ranges of one PinnedArena
pinned when the engine starts (pinned_arena.py: pinning while a request runs would hold up its
kernel launches), and a save is off the request's path: the state is copied on the device (a
fraction of a millisecond), the entry is live at once from that copy, and a thread of the cache's
own copies it into the arena on a stream of its own before the device copy is let go (a state is
hundreds of MB at 32k tokens: the request's first token does not wait for that copy). Where the
arena has no free range large enough, the least recently used host entries make room, or, while
the stored tier's queued writes hold the blocks of entries already evicted, the entry is copied to
pageable host memory instead (`_host_copies`); an entry whose copy fails is dropped. With a
StoredStates tier (stored_states.py) every saved entry is also written to disk in the background,
and a prompt that finds nothing live looks there. A stored entry stays live where it was read (on
a GPU a block of the arena); with `arriving` (a GPU's default) it is restored layer by layer as the
disk delivers it, beside the prefill of the new tokens (arriving_state.py), else read whole first.
"""

from __future__ import annotations

import array
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy
import torch
import xxhash

from flashpack.runtime.engine.arriving_state import ArrivingState
from flashpack.runtime.engine.pinned_arena import PinnedArena
from flashpack.runtime.state import SequenceState


def entry_key(length: int, digest: int) -> str:
    return f"{length}-{digest:016x}"


def prefix_digests(tokens: list[int], lengths: list[int]) -> dict[int, int]:
    """xxh64 of tokens[:L] for each L in `lengths` (each at most len(tokens)), in one pass."""
    hasher, done, digests = xxhash.xxh64(), 0, {}
    # int64 in the machine's order, as torch lays them out (stored entries' keys are these digests);
    # a request hashes its prompt a few times before its first token, and array converts a list of
    # ids several times faster than torch
    data = array.array("q", tokens).tobytes()
    for length in sorted(set(lengths)):
        hasher.update(data[8 * done:8 * length])
        done = length
        digests[length] = hasher.intdigest()
    return digests


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    stored_hits: int = 0
    tokens_reused: int = 0
    saved: int = 0
    evicted: int = 0
    restore_seconds: float = 0.0
    live_entries: int = 0
    live_bytes: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Entry:
    length: int
    state: SequenceState
    nbytes: int


@dataclass
class PrefixCache:
    ram_budget: int  # bytes of live entries
    stored: object | None = None  # stored_states.StoredStates
    pinned: PinnedArena | None = None  # where a GPU state's host copies go (needed to save one)
    arriving: bool = False  # a stored hit restored as it arrives (EngineConfig.restore_as_it_arrives)
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self._live: OrderedDict[str, _Entry] = OrderedDict()
        self._lengths: dict[int, int] = {}  # entry length -> live entries of that length
        self._lock = threading.Lock()  # the server's metrics thread reads stats while the engine saves
        self._copies: queue.Queue = queue.Queue()  # (key, length, device copy, its event, write)
        self._copier: threading.Thread | None = None  # started by the first save of a GPU state

    def restore_longest(self, tokens: list[int], state: SequenceState) -> int:
        """Restore into `state` the longest saved prefix of `tokens` that leaves a token to prefill;
        returns its length (0: nothing found, `state` untouched). With `arriving` a stored entry is
        restored as it arrives (arriving_state.py): its layers land as the model reaches them, all
        of them at `state.arrive_all()`, which raises StoredStateLost where the entry fails partway."""
        start = time.perf_counter()
        stored_keys = set(self.stored.keys()) if self.stored is not None else set()
        lengths = self._candidate_lengths(len(tokens) - 1, stored_keys)
        digests = prefix_digests(tokens, lengths) if lengths else {}
        for length in sorted(digests, reverse=True):
            key = entry_key(length, digests[length])
            saved, stored = self._live_state(key), False
            # only this prompt's own stored prefixes are read: other prompts' entries of the same
            # lengths would each cost a failed open (thousands in a long-running server's folder)
            if saved is None and key in stored_keys:
                arriving = self._arrive_stored(key, length, state, start) if self.arriving else None
                if arriving:
                    return length
                if arriving is None:  # read whole first (as configured, or no room in the arena)
                    saved, stored = self._read_stored(key, state), True
            if saved is None:
                continue
            state.restore(saved)
            if stored and _on_device(saved):  # a stored hit becomes live again
                self._keep_copy(key, length, state, write=False)
            elif stored:  # read into host memory (on a GPU the arena's): live as it stands
                self._keep(key, length, saved, write=False)
            with self._lock:
                self.stats.hits += 1
                self.stats.stored_hits += stored
                self.stats.tokens_reused += length
                self.stats.restore_seconds += time.perf_counter() - start
            return length
        with self._lock:
            self.stats.misses += 1
        return 0

    def save(self, tokens: list[int], state: SequenceState, owned: bool = False) -> None:
        """Keep `state` as the checkpoint after `tokens` (its position must be len(tokens)); `owned`:
        `state` is a copy no one else holds (a step's marked state), kept without copying it again."""
        if state.position != len(tokens) or not tokens:
            raise ValueError(f"a checkpoint of {len(tokens)} tokens needs a state at that position, not {state.position}")
        key = entry_key(len(tokens), prefix_digests(tokens, [len(tokens)])[len(tokens)])
        with self._lock:
            if key in self._live:
                self._live.move_to_end(key)
                return
        self._keep_copy(key, len(tokens), state, write=True, owned=owned)

    def flush(self) -> None:
        """Wait until every entry saved so far is in host memory and, with a stored tier, on disk."""
        self._copies.join()
        if self.stored is not None:
            self.stored.flush()

    def close(self) -> None:
        """Finish the pending copies and writes and stop the threads."""
        if self._copier is not None:
            self._copies.put(None)
            self._copier.join()
            self._copier = None
        if self.stored is not None:
            self.stored.close()

    def _keep_copy(self, key: str, length: int, state: SequenceState, write: bool, owned: bool = False) -> None:
        """Keep a copy of `state` (`owned`: `state` itself): on a CPU at once, from a GPU live now on
        the device and moved to pinned host memory by the copier thread."""
        saved = state if owned else state.snapshot()
        if not _on_device(saved):
            self._keep(key, length, saved, write)
            return
        if self.pinned is None:
            raise ValueError("a GPU state's live entry needs a PinnedArena for its host copy")
        copied = torch.cuda.Event()
        copied.record()
        self._keep(key, length, saved, write=False)
        if self._copier is None:
            self._copier = threading.Thread(target=self._copy_loop, args=(torch.cuda.current_device(),),
                                            name="flashpack-state-copies", daemon=True)
            self._copier.start()
        self._copies.put((key, length, saved, copied, write))

    def _copy_loop(self, device: int) -> None:
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream()
        while (item := self._copies.get()) is not None:
            key, length, saved, copied, write = item
            try:
                with torch.cuda.stream(stream):
                    stream.wait_event(copied)
                    host, written = self._host_copies(key, saved, write)
                stream.synchronize()
            except RuntimeError:  # the copy failed: the entry goes, its device copy with it
                host = written = None
            with self._lock:
                entry = self._live.get(key)
                if entry is not None and entry.state is saved:
                    if host is None:
                        self._forget(self._live.pop(key))
                        self.stats.live_entries = len(self._live)
                    else:
                        entry.state = host
            if written is not None:
                self.stored.put(key, length, written)
            item = saved = host = written = None  # the device copy goes before the next wait
            self._copies.task_done()
        self._copies.task_done()

    def _host_copies(self, key: str, saved: SequenceState, write: bool) -> tuple[SequenceState | None, SequenceState | None]:
        """(the copier thread, on its stream) The host copy of the device state `saved` that its
        live entry keeps, and the one its stored write reads (None: no write). The stored tier's
        queued writes hold the arena blocks of entries evicted since, until they are written: where
        the arena has no room while writes are queued, evicting live entries would free no block
        those writes hold, and waiting for the writes would hold this device copy (and the next
        saves') on the GPU for as long as they take. The state is then copied to pageable host
        memory, live and stored from there (its restore a slower copy than from pinned memory, far
        faster than a read from the disk). With no writes queued the least recently used host
        entries make room first. A state too large to be live is still stored."""
        writes_queued = self.stored is not None and self.stored.pending_bytes() > 0
        host = self.pinned.host_copy(saved) if writes_queued else self._host_copy(key, saved)
        stores = write and self.stored is not None
        if host is None and (stores or self._is_live(key)):
            host = saved.to(torch.device("cpu"))
        return host, host if stores else None

    def _is_live(self, key: str) -> bool:
        with self._lock:
            return key in self._live

    def _arrive_stored(self, key: str, length: int, state: SequenceState, started: float) -> bool | None:
        """Restore the stored entry `key` into `state` as the disk delivers it (arriving_state.py):
        read into a block of the arena on a GPU, a host buffer of its own on a CPU, and live from
        there once read whole and checked. True once started; False where the entry is missing or
        damaged before its tensors, None where the arena has no room: `state` untouched either way.
        A request whose entry fails partway is counted a miss (its prefill then starts afresh: the
        generator's)."""
        gpu = self.pinned is not None and _on_device(state)
        taken = []  # the arena's blocks asked for: None where it had no room
        buffer = self._arena_buffer(key, taken) if gpu else (lambda nbytes: numpy.empty(nbytes, dtype=numpy.uint8))
        found = self.stored.arriving(key, state, buffer)
        blocks = [block for block in taken if block is not None]
        if found is None:
            for block in blocks:
                block.release()
            return None if None in taken else False
        saved, read, ends = found
        opened = time.perf_counter() - started

        def done(saved: SequenceState, waited: float) -> None:
            for block in blocks:
                block.held_by(saved)
            self.stored.found(key)
            self._keep(key, length, saved, write=False)  # a stored hit becomes live again
            with self._lock:
                self.stats.hits += 1
                self.stats.stored_hits += 1
                self.stats.tokens_reused += length
                self.stats.restore_seconds += opened + waited

        def lost(error: BaseException | None) -> None:
            if gpu:  # copies out of the block may still be queued
                torch.cuda.current_stream().synchronize()
            for block in blocks:
                block.release()
            if error is not None:
                self.stored.lost(key, error)
                with self._lock:
                    self.stats.misses += 1

        ArrivingState(state, saved, read, ends, done, lost)
        return True

    def _read_stored(self, key: str, like: SequenceState) -> SequenceState | None:
        """The stored entry `key`: with an arena and a GPU state, read straight into a block of it
        (the restore is then one fast copy, and the entry is live from that block), else onto
        `like`'s device."""
        if self.pinned is None or not _on_device(like):
            return self.stored.get(key, like)
        taken = []
        found = self.stored.get(key, like, buffer=self._arena_buffer(key, taken))
        for block in (block for block in taken if block is not None):
            if found is not None and not _on_device(found):
                block.held_by(found)
            else:
                block.release()
        return found

    def _arena_buffer(self, key: str, taken: list):
        """A stored read's `buffer(nbytes)`: a block of the arena (other host entries than `key`
        evicted for room), its bytes as a numpy array, or None where there is none; each block asked
        for (or None) is appended to `taken`, for the caller to keep or release."""
        def buffer(nbytes: int):
            block = self._in_arena(key, lambda: self.pinned.block(nbytes))
            taken.append(block)
            return None if block is None else block.data.numpy()
        return buffer

    def _host_copy(self, key: str, saved: SequenceState) -> SequenceState | None:
        return self._in_arena(key, lambda: self.pinned.host_copy(saved))

    def _in_arena(self, key: str, attempt):
        """attempt() (a host copy or block of the arena, None where it has no room), the least
        recently used host entries other than `key` evicted while it finds none; None where evicting
        them all leaves no room."""
        while (found := attempt()) is None:
            with self._lock:
                oldest = next((k for k, entry in self._live.items() if k != key and not _on_device(entry.state)), None)
                if oldest is None:
                    return None
                self._forget(self._live.pop(oldest))
                self.stats.live_entries = len(self._live)
        return found

    def _keep(self, key: str, length: int, saved: SequenceState, write: bool) -> None:
        nbytes = saved.nbytes()
        if write and self.stored is not None:
            self.stored.put(key, length, saved)
        if nbytes > self.ram_budget:
            return
        with self._lock:
            self._live[key] = _Entry(length, saved, nbytes)
            self._lengths[length] = self._lengths.get(length, 0) + 1
            self.stats.saved += 1
            self.stats.live_bytes += nbytes
            while self.stats.live_bytes > self.ram_budget:
                _, dropped = self._live.popitem(last=False)
                self._forget(dropped)
            self.stats.live_entries = len(self._live)

    def _forget(self, entry: _Entry) -> None:
        self.stats.live_bytes -= entry.nbytes
        self.stats.evicted += 1
        left = self._lengths[entry.length] - 1
        if left:
            self._lengths[entry.length] = left
        else:
            del self._lengths[entry.length]

    def _live_state(self, key: str) -> SequenceState | None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return None
            self._live.move_to_end(key)
            return entry.state

    def _candidate_lengths(self, longest: int, stored_keys: set[str]) -> list[int]:
        with self._lock:
            lengths = [length for length in self._lengths if length <= longest]
        stored = (key.split("-", 1)[0] for key in stored_keys)  # a stray file's name need not parse
        return lengths + [int(length) for length in stored if length.isdigit() and int(length) <= longest]

    def to_dict(self) -> dict:
        with self._lock:
            found = self.stats.to_dict()
        if self.stored is not None:
            found["stored"] = self.stored.stats()
        return found


def _on_device(state: SequenceState) -> bool:
    return any(t.is_cuda for t in state.device_tensors())
