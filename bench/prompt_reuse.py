"""Prompt-state reuse: the time to first token (TTFT) of follow-ups with and without saved states,
live and after a restart that finds only the stored states.

    python bench/prompt_reuse.py PACK [--device cuda] [--vram-budget 24GiB --ram-budget 64GiB
        --emulate-layers 48 --hot-set '*'] [--document-tokens 32768] [--turns 10] --json OUT

Two scenarios, each skipped at 0:

  document  (`--document-tokens N`) a user message holding an N-token document (Python source,
            repeated as often as it takes, counted with the pack's tokenizer), answered with
            `--reply-tokens` tokens, then a follow-up question (~50 tokens) appended. The
            follow-up's TTFT is timed with no reuse, with a live hit and with a stored hit after
            a restart; all three send the same prompt. Then another question of the same kind (a
            second live hit on the same document): a first live hit may pay for what the engine
            does first when a prompt continues a restored state, the second shows a hit's own cost.
  turns     (`--turns N`) an agent-like conversation: each turn adds ~`--turn-tokens` tokens of
            Python source and a greedy `--reply-tokens` reply, the whole history sent again every
            turn. Each turn's TTFT with live reuse and with none (the same prompt), and the last
            turn's after a restart.

Replies go back as text, encoded again with the rest, as a chat client sends them. A trained
model's reply text encodes back to the tokens it generated, so a follow-up finds the checkpoint at
the end of the reply and prefills only the new turn; a synthetic pack's random replies do not
survive decoding (a 32-token reply comes back as 68 tokens), so there the follow-up prefills its
reply again. `--reply-ids` sends each reply back as the tokens generated instead (`chat_ids`): the
follow-up a trained model's client would send.

Two engines run it. The first answers everything live; "no reuse" is that engine with its prefix
cache set aside for the request (no restore, no checkpoint saved: what an engine with no cache does),
so both ways run on the same expert store at the same budget. The second is a fresh engine on the
same stored-states folder (a restart: nothing live), whose stored hits are read from the disk, not
the page cache: the stored files are written back and dropped from it (fsync, then posix_fadvise
DONTNEED) before each of its requests, and the share of their pages still cached is checked with
mincore. Each engine is warmed up (Engine.warm_up's prompts and decode steps, on a CPU too:
compile, tune, capture, first use) before anything is timed. The stored entry the document's
restart restored is then measured on its own: its size, the disk's read rate on it (O_DIRECT, the
bench's disk probe), a cold buffered read (what the stored tier does) and a cold read + decode
(StoredStates.get).

Budgets are for the full model; with `--emulate-layers L_full` they are scaled to the pack's layers
as `flashpack bench` scales them (runtime/bench/emulate.py), and every TTFT is also reported at
L_full layers (the JSON's "notes" say how). Output: the JSON and a markdown table (printed, and
written to `--table`, default the JSON's path with .md).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import gzip
import shutil
import json
import mmap
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy
import torch
import transformers

from flashpack.layout.pack import Pack
from flashpack.runtime.bench.bandwidth import disk_read
from flashpack.runtime.bench.clock import LayerSpan
from flashpack.runtime.bench.gaps import gpu_gaps, load_trace
from flashpack.runtime.bench.emulate import BUDGET_FORMULA, LayerKinds, check_layers, scale_to_layers, scaled_budgets
from flashpack.runtime.bench.first_use import device_segments_allocated, frames_compiled
from flashpack.runtime.bench.machine import machine_info
from flashpack.runtime.bench.sizes import model_sizes
from flashpack.runtime.engine.build import load_engine, parse_device, parse_dtype
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.prefix_cache import entry_key, prefix_digests
from flashpack.runtime.engine.settings import with_settings
from flashpack.runtime.engine.stored_states import SUFFIX
from flashpack.runtime.model.delta_rule import fla_kernels
from flashpack.runtime.sampling import SamplingParams
from flashpack.runtime.state import SequenceState
from flashpack.runtime.store.budget import parse_budget
from flashpack.runtime.store.config import StoreConfig

TURNS_SYSTEM = "You complete Python code."
# Another system message than the turns', so the two conversations share no prefix worth restoring.
DOCUMENT_SYSTEM = "You answer questions about the document the user gives you."
QUESTION = ("Going back to the document above: which functions in it decide when generation stops, and how do "
            "they use the stopping criteria the caller passes in? Answer with a short list, one line for each "
            "function, naming the arguments that matter most.")
# The second question: as long, about another part of the same document.
ANOTHER_QUESTION = ("Still about the document above: which functions in it prepare the inputs before the first "
                    "forward pass, and what do they do with the attention mask and the cache they are given? Answer "
                    "with a short list, one line for each function, naming the arguments it reads.")
# --ab-rounds' questions are QUESTION numbered 10, 11, ... (round_question): two digits each.
MAX_AB_ROUNDS = 45
# The engine's settings for short prompts (a follow-up's new tokens), by EngineConfig's names: the
# attribute the step or a model module holds each in. --ab-rounds' arm "aside" runs a request with
# every one (or those --ab-aside names) at its default on the engine's device (short_prompt_defaults).
SHORT_PROMPT_SETTINGS = {"prompt_graphs_max_tokens": "prompt_graphs_max_tokens",
                         "compile_prompt_pieces": "compile_pieces",
                         "delta_rule_recurrent_max_tokens": "recurrent_max_tokens",
                         "fused_norms": "use_kernel"}
# The targets issue 25 sets for the full model (48 layers): seconds.
LIVE_HIT_TARGET = 0.25
STORED_HIT_TARGET = 1.0
STORED_HIT_SLACK = 0.2  # where the disk is slower: the entry's bytes at the disk's rate, plus this


def source_text() -> str:
    """Python source the demo model knows (it was trained on transformers' sources)."""
    return (Path(transformers.__file__).parent / "generation" / "utils.py").read_text()


def source_turns(tokenizer, turns: int, tokens: int) -> list[str]:
    """`turns` pieces of Python source of about `tokens` tokens each."""
    ids = tokenizer.encode(source_text())
    return [tokenizer.tokenizer.decode(ids[i * tokens:(i + 1) * tokens]) for i in range(turns)]


def document_text(tokenizer, source: str, tokens: int) -> str:
    """`tokens` tokens of `source`, repeated as often as it takes (`tokenizer`: the pack's
    PackTokenizer). Decoded text may encode to a token or two more or fewer at the seams."""
    ids = tokenizer.encode(source)
    if not ids:
        raise ValueError("the document's source text encodes to no tokens")
    return tokenizer.tokenizer.decode((ids * -(-tokens // len(ids)))[:tokens])


def layer_counts(linear: list[bool], ple: list[bool], full_layers: int) -> dict[str, tuple[float, float]]:
    """Decoder layers of each kind, {"deltanet" | "attention": (in the pack, in the full model)}:
    the full model's continue the pack's attention pattern (LayerKinds); where the pattern cannot be
    read off the pack, each kind is scaled evenly with the layer count."""
    pack = {"deltanet": sum(linear), "attention": len(linear) - sum(linear)}
    tail = LayerKinds.of(linear, ple, full_layers).tail
    if tail is None:
        return {kind: (count, count * full_layers / len(linear)) for kind, count in pack.items()}
    return {kind: (count, count + tail.count(kind)) for kind, count in pack.items()}


def state_parts(state: SequenceState, decoder_layers: int) -> dict[str, int]:
    """A state's bytes by what they scale with: the decoder's DeltaNet layers, its attention layers,
    and the rest (PLE states and the MTP layers' caches, one of each whatever the layer count)."""
    deltanet = sum(t.numel() * t.element_size() for s in state.deltanet.values() for t in (s.conv, s.recurrent))
    attention = sum(cache.nbytes() for layer, cache in state.attention.items() if layer < decoder_layers)
    return {"deltanet": deltanet, "attention": attention, "other": state.nbytes() - deltanet - attention}


@dataclass(frozen=True)
class StateBytes:
    """A saved state's bytes by part (state_parts), linear in its tokens: fixed + per_token * tokens."""

    fixed: dict[str, float]
    per_token: dict[str, float]

    @classmethod
    def from_states(cls, short: tuple[int, dict[str, int]], long: tuple[int, dict[str, int]]) -> StateBytes:
        """From two states' parts, (tokens, parts) each."""
        (a, at_a), (b, at_b) = short, long
        per_token = {part: (at_b[part] - at_a[part]) / (b - a) for part in at_a}
        return cls({part: at_a[part] - per_token[part] * a for part in at_a}, per_token)

    def at(self, tokens: int, counts: dict[str, tuple[float, float]] | None = None) -> float:
        """Bytes of a state after `tokens` tokens; with `counts` (layer_counts), at the full model's
        layer count: each kind's layers' bytes scaled by full / pack, the rest as it is."""
        total = 0.0
        for part, fixed in self.fixed.items():
            bytes_ = fixed + self.per_token[part] * tokens
            if counts is not None and part in counts and counts[part][0]:
                bytes_ *= counts[part][1] / counts[part][0]
            total += bytes_
        return total


class RequestClocks:
    """What a bench times inside an engine's requests beside their TTFT: the seconds its prefix cache
    spends saving checkpoints (a request's prefill saves the state at each checkpoint before its first
    token, so that is part of its TTFT; on a GPU a device copy, moved to the host off the request's
    path), and its decoder layers' span (runtime/bench/clock.py, LayerSpan), the part of a TTFT
    that grows with the layers."""

    def __init__(self, engine):
        self.saves = 0.0
        cache = engine.generator.prefix_cache
        self._save = cache.save
        cache.save = self._timed
        self.layers = LayerSpan(engine.step.model, engine.step.checked)

    def _timed(self, tokens, state, **options) -> None:
        start = time.perf_counter()
        try:
            self._save(tokens, state, **options)
        finally:
            self.saves += time.perf_counter() - start


def _short_prompt_holders(engine) -> list[tuple[object, str, str]]:
    """(holder, attribute, EngineConfig's name) for each of SHORT_PROMPT_SETTINGS the engine's step
    and its model's modules hold."""
    return [(holder, attribute, name) for holder in (engine.step, *engine.step.model.modules())
            for name, attribute in SHORT_PROMPT_SETTINGS.items() if hasattr(holder, attribute)]


def short_prompt_defaults(engine) -> dict:
    """SHORT_PROMPT_SETTINGS as an engine on this one's device takes them where none is set."""
    config, fla = EngineConfig(), fla_kernels(engine.step.model.device)
    return {name: config.recurrent_max_tokens(fla) if name == "delta_rule_recurrent_max_tokens"
            else getattr(config, name) for name in SHORT_PROMPT_SETTINGS}


def short_prompt_settings(engine) -> dict:
    """SHORT_PROMPT_SETTINGS as the engine holds them now, by EngineConfig's names (a module setting:
    its largest, True where any module has it)."""
    holders, defaults = _short_prompt_holders(engine), short_prompt_defaults(engine)
    return {name: max((getattr(holder, attribute) for holder, attribute, held in holders if held == name),
                      default=defaults[name])
            for name in SHORT_PROMPT_SETTINGS}


@contextmanager
def short_prompt_paths_aside(engine, names: Sequence[str] = tuple(SHORT_PROMPT_SETTINGS)):
    """The engine's prompts for a while with SHORT_PROMPT_SETTINGS (or those of `names`) at
    the defaults on the engine's device (short_prompt_defaults): no checked-step chunks, the layers'
    plain code rather than their compiled pieces, the norms' plain code rather than their kernel,
    the delta rule's recurrence up to the device's default. What was set stays warm (graphs,
    compiled code) for the next request that takes it."""
    holders = [holder for holder in _short_prompt_holders(engine) if holder[2] in names]
    kept = [(holder, attribute, getattr(holder, attribute)) for holder, attribute, _ in holders]
    defaults = short_prompt_defaults(engine)
    for holder, attribute, name in holders:
        setattr(holder, attribute, defaults[name])
    try:
        yield
    finally:
        for holder, attribute, value in kept:
            setattr(holder, attribute, value)


@contextmanager
def reuse_off(engine):
    """The engine without its prefix cache for a while: nothing restored, nothing saved."""
    cache, engine.generator.prefix_cache = engine.generator.prefix_cache, None
    try:
        yield
    finally:
        engine.generator.prefix_cache = cache


# What the expert store did before a request's first token: where its records came from.
STORE_COUNTS = ("requests", "device_hits", "host_hits", "disk_reads", "bytes_host_to_device", "bytes_disk_to_host",
                "prefetch_issued", "prefetch_from_disk")


def store_counts(engine) -> dict | None:
    """The store's totals of STORE_COUNTS and its seconds waiting on loads (None without a store)."""
    if engine.store is None:
        return None
    stats = engine.store.stats
    total = stats.total()
    return {**{name: getattr(total, name) for name in STORE_COUNTS}, "wait_s": stats.wait_seconds}


def request(engine, ids: list[int], max_tokens: int, clocks: RequestClocks) -> dict:
    """Answer `ids` (checkpoints at its message boundaries, as the server does); its TTFT, tokens
    restored, the seconds of that restore, of the checkpoints saved, of the decoder layers' span and
    of the garbage collector's pauses (all of them, and the longest), what the expert store moved,
    and the frames compiled and device memory segments allocated (runtime/bench/first_use.py),
    before the first token."""
    cache = engine.generator.prefix_cache
    counted_before, first_use_before = store_counts(engine), (frames_compiled(), device_segments_allocated())
    restored_before = cache.stats.restore_seconds if cache is not None else 0.0
    saved_before = clocks.saves
    collected_before, mark = engine.collector.pauses(), engine.collector.mark()
    saved = layers = collected = longest = counted = first_use = None
    pieces, generated, last = [], [], None
    clocks.layers.take()
    clocks.layers.on = True
    try:
        for event in engine.generator.stream(ids, SamplingParams(max_tokens=max_tokens),
                                             checkpoints=engine.tokenizer.message_starts(ids)):
            if saved is None:  # the first event comes once the first token is chosen
                saved = clocks.saves - saved_before if cache is not None else 0.0
                layers = clocks.layers.take()
                clocks.layers.on = False
                collected = engine.collector.pauses().since(collected_before)
                longest = engine.collector.longest_since(mark)
                counted, first_use = store_counts(engine), (frames_compiled(), device_segments_allocated())
            pieces.append(event.text)
            if event.token_id is not None:
                generated.append(event.token_id)
            last = event
    finally:
        clocks.layers.on = False
    cached = last.timings["cached_tokens"]
    return {"prompt_tokens": len(ids), "cached_tokens": cached, "new_tokens": len(ids) - cached,
            "ttft_s": last.timings["first_token_seconds"],
            "restore_s": cache.stats.restore_seconds - restored_before if cache is not None else 0.0,
            "saves_s": saved, "layers_s": layers, "gc_s": sum(collected.seconds), "gc_full_collections": collected.counts[2],
            "gc_longest_s": longest, "frames_compiled": first_use[0] - first_use_before[0],
            "device_segments_allocated": first_use[1] - first_use_before[1], "text": "".join(pieces), "reply_ids": generated,
            "store": None if counted is None else {name: counted[name] - counted_before[name] for name in counted}}


def chat_ids(tokenizer, messages: list[dict], replies: dict[int, list[int]] | None) -> list[int]:
    """The prompt ids of `messages`, as a client sending the whole conversation makes the server
    encode them; with `replies` (message index -> the tokens generated for that assistant message),
    each such reply is the tokens generated rather than its text encoded again. A trained model's
    reply text encodes back to the tokens it generated, so its reply's checkpoint is found; a
    synthetic pack's random tokens do not survive decoding to text (32 of them came back as 68), so
    without `replies` its follow-ups prefill their replies again (--reply-ids)."""
    ids = tokenizer.encode_chat(messages)
    for index in sorted(replies or {}, reverse=True):  # from the last: earlier positions stay put
        start = len(tokenizer.encode_chat(messages[:index]))  # the prompt the reply answered
        text_ids = tokenizer.encode(messages[index]["content"])
        if ids[start:start + len(text_ids)] != text_ids:
            raise ValueError(f"message {index} is not rendered as its text's tokens after the prompt it answered")
        ids[start:start + len(text_ids)] = replies[index]
    return ids


def conversation(engine, messages: list[dict], turns: list[str], reply_tokens: int, clocks: RequestClocks,
                 replies: dict[int, list[int]] | None = None) -> list[dict]:
    """Each turn of `turns` appended to `messages` (in place) and answered, the reply appended too
    (and its tokens to `replies`, where given: chat_ids)."""
    rows = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        ids = chat_ids(engine.tokenizer, messages, replies)
        row = request(engine, ids, reply_tokens, clocks)
        if replies is not None:
            replies[len(messages)] = row["reply_ids"]
        messages.append({"role": "assistant", "content": row.pop("text")})
        row.pop("reply_ids")
        rows.append({**row, "ids": ids})
    return rows


def forget_stored(stored, keep: set[str], longer_than: int) -> list[str]:
    """Remove the stored entries not in `keep` of more than `longer_than` tokens (what a timed
    follow-up saved of itself, which a restart answering that follow-up again must not find)."""
    removed = []
    for key in stored.keys():
        if key not in keep and int(key.split("-", 1)[0]) > longer_than:
            (stored.folder / f"{key}{SUFFIX}").unlink(missing_ok=True)
            removed.append(key)
    return removed


def stored_files(stored) -> list[Path]:
    return sorted(stored.folder.glob(f"*{SUFFIX}"))


def drop_from_page_cache(paths: Iterable[Path]) -> None:
    """Write the files back and drop their pages from the page cache, so the next read is the disk's:
    fsync first (dirty pages are not dropped), then posix_fadvise DONTNEED."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # removed by the stored tier's eviction meanwhile
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(paths: Iterable[Path]) -> float | None:
    """The share of the files' pages in the page cache (mincore on a mapping of each), None where it
    cannot be told: the check that a drop worked (tmpfs, for one, keeps every page)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    cached = total = 0
    for path in paths:
        try:
            size = path.stat().st_size
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            pages = -(-size // page)
            if not pages:
                continue
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address is None or address == ctypes.c_void_p(-1).value:
                return None
            try:
                vector = (ctypes.c_ubyte * pages)()
                if libc.mincore(address, size, vector) != 0:
                    return None
                cached += int((numpy.frombuffer(vector, dtype=numpy.uint8) & 1).sum())
            finally:
                libc.munmap(address, size)
            total += pages
        finally:
            os.close(fd)
    return cached / total if total else None


def restart_request(engine, ids: list[int], clocks: RequestClocks) -> dict:
    """A request of the restarted engine, its stored states read from the disk (module docstring)."""
    stored = engine.generator.prefix_cache.stored
    engine.generator.prefix_cache.flush()  # its own earlier requests' entries are written before the files are dropped
    files = stored_files(stored)
    drop_from_page_cache(files)
    left = cached_fraction(files)
    row = request(engine, ids, 1, clocks)
    row.pop("text")
    row.pop("reply_ids")
    return {**row, "stored_pages_cached_before": left}


def measure_entry(engine, ids: list[int], length: int) -> dict | None:
    """The stored entry of ids[:length] on its own: bytes, the disk's read rate on it (O_DIRECT),
    a cold buffered read's and a cold read + decode's seconds (StoredStates.get onto the device)."""
    stored = engine.generator.prefix_cache.stored
    if not length:
        return None
    name = f"{entry_key(length, prefix_digests(ids, [length])[length])}{SUFFIX}"
    path = stored.folder / name
    if not path.exists():
        return None
    size = path.stat().st_size
    drop_from_page_cache([path])
    direct = disk_read(stored.folder, [name], limit=size)
    drop_from_page_cache([path])
    start = time.perf_counter()
    path.read_bytes()
    buffered = time.perf_counter() - start
    drop_from_page_cache([path])
    cached = cached_fraction([path])
    like = engine.step.new_state()
    start = time.perf_counter()
    state = stored.get(name[:-len(SUFFIX)], like)
    if torch.device(engine.config.device).type == "cuda":
        torch.cuda.synchronize()
    decoded = time.perf_counter() - start
    return {"tokens": length, "file_bytes": size, "state_bytes": state.nbytes() if state is not None else None,
            "disk_read": {key: direct[key] for key in ("bytes_per_s", "method", "o_direct", "fallback_reason")},
            "buffered_cold_read_s": buffered, "buffered_cold_read_bytes_per_s": size / buffered,
            "read_decode_s": decoded, "pages_cached_before_read_decode": cached}


def state_bytes(engine) -> StateBytes:
    """A saved state's bytes by part, from states after 1,000 and 2,000 tokens."""
    layers = engine.model_config.num_hidden_layers
    found = []
    for tokens in (1000, 2000):
        state = engine.step.new_state()
        engine.step.forward(torch.arange(tokens) % 1000 + 5, state, last_only=True)
        found.append((tokens, state_parts(state.snapshot(), layers)))
    return StateBytes.from_states(*found)


def at_layers(row: dict, layer_scale: float, bytes_scale: float) -> float:
    """A TTFT at the full model's layer count: restoring and saving states move state bytes
    (scaled by `bytes_scale`), the garbage collector's pauses walk the process's heap (as they are),
    the decoder layers' span (`layers_s`, at most what is left) is the layers' work (scaled by
    `layer_scale`), and the rest is what a request does once (as it is). A row without `layers_s`
    counts all the rest as the layers'."""
    moved = row["restore_s"] + row["saves_s"]
    rest = row["ttft_s"] - moved - row["gc_s"]
    layers = rest if row.get("layers_s") is None else min(row["layers_s"], rest)
    return moved * bytes_scale + row["gc_s"] + (rest - layers) + layers * layer_scale


def free_memory() -> None:
    """Give back what a closed engine held (its device memory, its pinned host memory) before the
    next one loads: the budgets are the next engine's alone."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def started(pack: str, config: EngineConfig) -> tuple[object, dict]:
    start = time.perf_counter()
    engine = load_engine(pack, config)
    loaded = time.perf_counter() - start
    # Engine.warm_up's own work, on a CPU too (where it skips it: nothing is compiled there), so that
    # no first request pays for first use (the pack's pages mapped, the linear algebra set up).
    lengths, depth = engine.warm_up_plan()
    warm = engine.generator.warm_up(lengths, prompt_depth=depth) | engine.freeze_heap()
    return engine, {"load_s": loaded, "warm_up_s": sum(warm.values()), "warm_up": warm, "memory": engine.memory()}


def engine_arguments(description: str) -> argparse.ArgumentParser:
    """A parser with the pack and the engine's device, budgets and hot set (bench/first_requests.py's too)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("pack")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default %(default)s)")
    parser.add_argument("--vram-budget", help="the full model's VRAM budget, e.g. 24GiB (default: the engine's)")
    parser.add_argument("--ram-budget", help="the full model's RAM budget, e.g. 64GiB (default: the engine's)")
    parser.add_argument("--emulate-layers", type=int,
                        help="the full model's decoder layers: budgets are scaled from it to the pack's and "
                             "times reported at it too (default: the pack's own, nothing scaled)")
    parser.add_argument("--hot-set",
                        help="pre-warm the tiers from this manifest profile, '*' for every record (default: none)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = engine_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-cache-ram",
                        help="live states' host memory (default: the engine's, EngineConfig.prompt_cache_ram: on "
                             "a GPU what the RAM budget leaves beyond the experts' records, at least one "
                             "32k-token state, at most a tenth; on a CPU 1 GiB)")
    parser.add_argument("--states-dir", type=Path,
                        help="where the stored states go: a fresh folder inside it, removed at the end "
                             "(default: the system's temporary folder; put it on the disk to measure)")
    parser.add_argument("--document-tokens", type=int, default=0,
                        help="the document's tokens (default %(default)s: no document)")
    parser.add_argument("--turns", type=int, default=10,
                        help="turns of the conversation, 0 for none (default %(default)s)")
    parser.add_argument("--turn-tokens", type=int, default=500,
                        help="new tokens of each turn's user message (default %(default)s)")
    parser.add_argument("--reply-tokens", type=int, default=32,
                        help="tokens of each greedy reply (default %(default)s)")
    parser.add_argument("--reply-ids", action="store_true",
                        help="send each reply back as the tokens generated, as a trained model's reply text "
                             "encodes back to them (a synthetic pack's random replies do not: without this "
                             "their follow-ups prefill the reply again)")
    parser.add_argument("--ab-rounds", type=int, default=0,
                        help="after the document's live hits, this many pairs more, each a new question asked "
                             "with the engine's short-prompt settings as --set gives them (prompt_graphs_max_tokens, "
                             "compile_prompt_pieces, delta_rule_recurrent_max_tokens, fused_norms) and with them at their "
                             "defaults, alternately in one process (default %(default)s: none)")
    parser.add_argument("--ab-aside", dest="asides", action="append", type=parse_aside, metavar="SETTING[,SETTING]",
                        help="--ab-rounds' other arm sets only these short-prompt settings to their defaults "
                             "(repeatable: a series of rounds each, in one process; default: one series, all of them)")
    parser.add_argument("--trace", type=Path,
                        help="profile the document's first live hit: its Chrome trace into this folder")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine setting by name, as `flashpack bench --set` takes it")
    parser.add_argument("--json", type=Path, required=True, help="the report")
    parser.add_argument("--table", type=Path, help="the markdown table (default: the JSON's path with .md)")
    return parser.parse_args(argv)


@contextmanager
def traced(folder: Path | None, name: str, found: dict):
    """Run the block under torch.profiler (host and, on a GPU, device) where `folder` is given:
    folder/trace-NAME.json.gz (with the Python calls, so a span of host time can be put down to the
    module that spent it), folder/profile-NAME.txt (operators and Python calls by host time,
    operators by device time) and, on a GPU, in found[name] the GPU's idle time by what the host
    was doing."""
    if folder is None:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        yield
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / f"trace-{name}.json"
    prof.export_chrome_trace(str(trace))
    events = prof.key_averages()
    (folder / f"profile-{name}.txt").write_text("\n\n".join(
        events.table(sort_by=key, row_limit=rows) for key, rows in (
            ("cpu_time_total", 100), ("self_cpu_time_total", 30), ("self_device_time_total", 30))))
    if torch.cuda.is_available():
        found[name] = gpu_gaps(load_trace(trace), 1)
    with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()


def document_scenario(engine, args, clocks: RequestClocks) -> tuple[dict, list[int]]:
    """The document's first turn, then its follow-up with no reuse and with a live hit, then another
    question's live hit; returns the rows and the first follow-up's prompt. The stored tier is left as
    the first turn left it."""
    stored = engine.generator.prefix_cache.stored
    text = document_text(engine.tokenizer, source_text(), args.document_tokens)
    messages = [{"role": "system", "content": DOCUMENT_SYSTEM}, {"role": "user", "content": text}]
    first = request(engine, engine.tokenizer.encode_chat(messages), args.reply_tokens, clocks)
    engine.generator.prefix_cache.flush()  # the follow-up comes once the first turn's states are stored (its reply is read first)
    first_turn_keys = set(stored.keys())
    first_reply = first.pop("reply_ids")
    replies = {len(messages): first_reply} if args.reply_ids else None
    messages += [{"role": "assistant", "content": first.pop("text")}, {"role": "user", "content": QUESTION}]
    follow_up = chat_ids(engine.tokenizer, messages, replies)
    with reuse_off(engine):
        plain = request(engine, follow_up, 1, clocks)
    profiles: dict = {}
    with traced(args.trace, "live-hit", profiles):
        hit = request(engine, follow_up, 1, clocks)
    engine.generator.prefix_cache.flush()
    messages[-1] = {"role": "user", "content": ANOTHER_QUESTION}
    again = request(engine, chat_ids(engine.tokenizer, messages, replies), 1, clocks)
    engine.generator.prefix_cache.flush()
    rounds = ab_rounds(engine, messages, replies, args.ab_rounds, clocks, args.asides or (tuple(SHORT_PROMPT_SETTINGS),))
    forget_stored(stored, first_turn_keys, min(row["cached_tokens"] for row in (hit, again, *rounds)))
    for row in (plain, hit, again):
        row.pop("text")
        row.pop("reply_ids")
    return {"document_tokens": len(engine.tokenizer.encode(text)),
            "question_tokens": len(engine.tokenizer.encode(QUESTION)),
            "first_turn": first, "no_reuse": plain, "live_hit": hit, "live_hit_again": again,
            "ab_rounds": rounds, "short_prompt_settings": short_prompt_settings(engine),
            "short_prompt_defaults": short_prompt_defaults(engine),
            "profiles": profiles}, follow_up


def round_question(index: int) -> str:
    """The index-th (0 to 2 * MAX_AB_ROUNDS - 1) of --ab-rounds' questions: QUESTION numbered
    with two digits, so that each encodes to as many tokens and every hit prefills as many."""
    if not 0 <= index < 2 * MAX_AB_ROUNDS:
        raise ValueError(f"round question {index} is past the {2 * MAX_AB_ROUNDS} of two digits")
    return f"Question {10 + index}: {QUESTION}"


def ab_rounds(engine, messages: list[dict], replies: dict | None, rounds: int, clocks: RequestClocks,
              asides: Sequence[Sequence[str]] = (tuple(SHORT_PROMPT_SETTINGS),)) -> list[dict]:
    """For each of `asides` (settings by EngineConfig's names), `rounds` pairs of live hits on the
    document, in each pair one with the engine's short-prompt settings as set and one with those
    set aside (short_prompt_paths_aside), as set first, then aside first, in turn (ABBA), in one
    process: an A/B with the engine, its store and its state the same. Each hit asks a question of
    its own (the same length: round_question), since a prompt's own checkpoint would answer it again
    with nothing left to prefill."""
    rows = []
    for aside in asides:
        for number in range(rounds):
            for as_set in (True, False) if number % 2 == 0 else (False, True):  # ABBA: a place in the pair favours neither
                messages[-1] = {"role": "user", "content": round_question(len(rows))}
                with nullcontext() if as_set else short_prompt_paths_aside(engine, aside):
                    row = request(engine, chat_ids(engine.tokenizer, messages, replies), 1, clocks)
                engine.generator.prefix_cache.flush()
                row.pop("text")
                row.pop("reply_ids")
                rows.append({**row, "as_set": as_set, "round": number + 1, "aside": list(aside)})
    return rows


def ab_summary(rows: Sequence[dict]) -> str:
    """One series of --ab-rounds' pairs in a line: each arm's median TTFT, their ratio, the pairs won."""
    median = {as_set: statistics.median(row["ttft_s"] for row in rows if row["as_set"] == as_set) for as_set in (True, False)}
    pairs: dict[int, dict[bool, float]] = {}
    for row in rows:
        pairs.setdefault(row["round"], {})[row["as_set"]] = row["ttft_s"]
    ahead = sum(pair[True] < pair[False] for pair in pairs.values())
    return (f"Median TTFT: as set {median[True]:.3f} s, aside {median[False]:.3f} s (as set / aside "
            f"{median[True] / median[False]:.2f}); as set ahead in {ahead} of {len(pairs)} pairs.")


def parse_aside(text: str) -> tuple[str, ...]:
    """--ab-aside's SETTING[,SETTING...] -> the names, each one of SHORT_PROMPT_SETTINGS."""
    names = tuple(name for name in text.split(",") if name)
    unknown = [name for name in names if name not in SHORT_PROMPT_SETTINGS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"--ab-aside takes names of {', '.join(SHORT_PROMPT_SETTINGS)}, "
                                         f"comma-separated; got {text!r}")
    return names


def turns_scenario(engine, args, clocks: RequestClocks) -> tuple[dict, list[int], set[str]]:
    """The conversation with reuse, then each turn's prompt again with reuse set aside; returns the
    rows, the last turn's prompt and the stored entries there were before the last turn."""
    messages = [{"role": "system", "content": TURNS_SYSTEM}]
    pieces = source_turns(engine.tokenizer, args.turns, args.turn_tokens)
    replies: dict[int, list[int]] | None = {} if args.reply_ids else None
    rows = conversation(engine, messages, pieces[:-1], args.reply_tokens, clocks, replies)
    engine.generator.prefix_cache.flush()  # every turn before the last is stored: the restart finds them
    before_last = set(engine.generator.prefix_cache.stored.keys())
    rows += conversation(engine, messages, pieces[-1:], args.reply_tokens, clocks, replies)
    for row in rows:
        with reuse_off(engine):
            plain = request(engine, row.pop("ids"), 1, clocks)
        plain.pop("text")
        plain.pop("reply_ids")
        row.update(ttft_no_reuse_s=plain["ttft_s"], no_reuse=plain)
    last = len(messages) - 1  # the last turn's prompt, without its reply
    kept = None if replies is None else {index: ids for index, ids in replies.items() if index < last}
    return {"rows": rows}, chat_ids(engine.tokenizer, messages[:last], kept), before_last


def main() -> None:
    args = parse_args()
    if args.turns < 0 or args.document_tokens < 0 or not args.turns and not args.document_tokens:
        raise SystemExit("give --turns or --document-tokens a positive count")
    series = len(args.asides or [()])
    if not 0 <= args.ab_rounds * series <= MAX_AB_ROUNDS or args.ab_rounds and not args.document_tokens:
        raise SystemExit(f"--ab-rounds takes 0 to {MAX_AB_ROUNDS} pairs in all (rounds x --ab-aside series) "
                         "and needs --document-tokens")
    if args.asides and not args.ab_rounds:
        raise SystemExit("--ab-aside needs --ab-rounds")
    device = parse_device(args.device)
    manifest = Pack.open(args.pack).manifest
    cfg = manifest.config
    layers = cfg.num_hidden_layers
    target = check_layers(layers, args.emulate_layers)
    sizes = model_sizes(manifest, parse_dtype(EngineConfig.dtype, device), device)
    typed = {"vram": parse_budget(args.vram_budget, "--vram-budget"),
             "ram": parse_budget(args.ram_budget, "--ram-budget")}
    fixed, budgets = scaled_budgets(typed, sizes.device_fixed, layers, target)
    counts = layer_counts([cfg.is_linear(i) for i in range(layers)],
                          [cfg.ple_index(i) is not None for i in range(layers)], target)
    report = {"machine": machine_info(device),
              "command": shlex.join(["python", "bench/prompt_reuse.py", *sys.argv[1:]]),
              "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
              "budgets": {"typed": typed, "fixed": fixed, "engine": budgets, "layers_typed_for": target,
                          "pack_layers": layers, "formula": BUDGET_FORMULA},
              "layer_counts": {kind: {"pack": pack, "full": full} for kind, (pack, full) in counts.items()}}
    if args.states_dir is not None:
        args.states_dir.mkdir(parents=True, exist_ok=True)
    document = turns = entry = None
    with tempfile.TemporaryDirectory(prefix="prompt-states-", dir=args.states_dir) as folder:
        # speculation off: a follow-up's TTFT is its prefill, and no MTP head takes a share of the budgets
        config = with_settings(EngineConfig(device=args.device, prompt_cache_ram=args.prompt_cache_ram,
                                            prompt_cache_dir=folder, speculate="off",
                                            store=StoreConfig(vram_budget=budgets["vram"], ram_budget=budgets["ram"],
                                                              hot_set=args.hot_set)), args.settings)
        report["config"] = asdict(config)
        report["engines"] = {}
        live, report["engines"]["live"] = started(args.pack, config)
        stored = live.generator.prefix_cache.stored
        clocks = RequestClocks(live)
        if args.document_tokens:
            document, follow_up = document_scenario(live, args, clocks)
        if args.turns:
            turns, last_prompt, before_last = turns_scenario(live, args, clocks)
        by_part = state_bytes(live)
        report["live"] = live.generator.prefix_cache.to_dict()
        live.close()  # waits for the stored writes
        if turns is not None:
            forget_stored(stored, before_last, turns["rows"][-1]["cached_tokens"])
        del live, stored, clocks
        free_memory()

        restarted, report["engines"]["restarted"] = started(args.pack, config)  # nothing live: stored states only
        clocks = RequestClocks(restarted)
        if document is not None:
            document["stored_hit"] = restart_request(restarted, follow_up, clocks)
        if turns is not None:
            turns["restart"] = restart_request(restarted, last_prompt, clocks)
        report["restarted"] = restarted.generator.prefix_cache.to_dict()
        if document is not None:
            entry = document["stored_entry"] = measure_entry(restarted, follow_up,
                                                             document["stored_hit"]["cached_tokens"])
        largest = max((path.stat().st_size for path in Path(folder).rglob(f"*{SUFFIX}")), default=None)
        restarted.close()

    timed = []  # every timed request
    if document is not None:
        timed += [document[key] for key in ("first_turn", "no_reuse", "live_hit", "live_hit_again", "stored_hit")]
        timed += document["ab_rounds"]
    if turns is not None:
        timed += turns["rows"] + [row["no_reuse"] for row in turns["rows"]] + [turns["restart"]]
    scale_rows(timed, document, entry, by_part, counts, layers, target)
    longest = max(row["prompt_tokens"] for row in timed)
    report.update(
        document=document, turns=turns,
        entry_bytes={"fixed": by_part.at(0), "per_1k_tokens": by_part.at(1000) - by_part.at(0),
                     "fixed_at_layers": by_part.at(0, counts),
                     "per_1k_tokens_at_layers": by_part.at(1000, counts) - by_part.at(0, counts),
                     "by_part": asdict(by_part), "largest_stored_file": largest, "longest_prompt_tokens": longest,
                     # the restored entry's own ratio where there is one, else the largest file's to the
                     # longest prompt's state (an estimate: that file may hold a few tokens fewer)
                     "stored_over_raw": entry["file_bytes"] / entry["state_bytes"] if entry and entry["state_bytes"]
                     else None if largest is None else largest / by_part.at(longest)},
        notes=notes(layers, target))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(report)
    path = args.table or args.json.with_suffix(".md")
    path.write_text(table)
    print(table, end="")
    print(f"wrote {args.json} and {path}")


def scale_rows(timed: list[dict], document: dict | None, entry: dict | None, by_part: StateBytes,
               counts: dict[str, tuple[float, float]], layers: int, target: int) -> None:
    """Each timed request's TTFT at `target` layers (notes()["scaling"]), the stored entry's bytes
    there and the targets at that count."""
    layer_scale = scale_to_layers(1.0, 0.0, layers, target)
    ratio = lambda tokens: by_part.at(tokens, counts) / by_part.at(tokens)  # noqa: E731
    for row in timed:
        row["ttft_at_layers_s"] = at_layers(row, layer_scale, ratio(row["prompt_tokens"]))
        if "no_reuse" in row:
            row["ttft_no_reuse_at_layers_s"] = at_layers(row["no_reuse"], layer_scale, ratio(row["prompt_tokens"]))
    if entry is not None:
        entry["file_bytes_at_layers"] = entry["file_bytes"] * ratio(entry["tokens"])
        entry["stored_hit_target_s"] = max(STORED_HIT_TARGET, entry["file_bytes_at_layers"]
                                           / entry["disk_read"]["bytes_per_s"] + STORED_HIT_SLACK)
    if document is not None:
        stored_target = entry["stored_hit_target_s"] if entry is not None else None
        document["targets"] = {
            "layers": target, "live_hit_s": LIVE_HIT_TARGET,
            "live_hit_met": document["live_hit"]["ttft_at_layers_s"] <= LIVE_HIT_TARGET,
            "stored_hit_s": stored_target,
            "stored_hit_met": None if stored_target is None
            else document["stored_hit"]["ttft_at_layers_s"] <= stored_target}


def notes(layers: int, target: int) -> dict[str, str]:
    scaled = layers != target
    return {
        "engines": "Two engines: the first answers everything live, and 'no reuse' is it with its prefix cache set "
                   "aside for the request (no restore, no checkpoint saved), on the same expert store at the same "
                   "budget; the second is a fresh engine in the same process on the same stored-states folder (a "
                   "restart: nothing live; its kernels already compiled, as a restarted server finds them in the "
                   "compile caches on disk). Each is warmed up before anything is timed (Engine.warm_up's prompts of "
                   "each shape class and decode steps, run on a CPU too), so no first request's compile, tuning or "
                   "capture time is counted.",
        "ttft": "TTFT is the generator's first_token_seconds: from the request to its first token chosen, the "
                "restore, the prefill of what was not restored and the checkpoints saved before the first token "
                "(a host copy of the state at each message boundary) included. restore_s and saves_s are those two "
                "parts (a stored hit's state is restored as it arrives, layer by layer beside the prefill: its "
                "restore_s is the opening and the waits for bytes the layers did not hide); gc_s the garbage collector's pauses before the first token (gc_longest_s the longest, "
                "gc_full_collections the full ones), whatever thread they stopped: the heap is frozen after each "
                "warm-up unless --set freeze_heap=false (runtime/engine/collector.py).",
        "document": "The follow-up (first turn, its reply, then the question) is the same prompt each way. The first "
                    "turn's stored writes are flushed before it (the user reads the reply first). Before the "
                    "restart the entries the live follow-up saved of itself are removed, so the restarted engine "
                    "finds what the first turn left, as the live hit did.",
        "turns": "Each turn's prompt is answered with reuse as the conversation goes (its stored writes in the "
                 "background, none awaited), then again with reuse set aside. The restart answers the last turn "
                 "again, finding the stored states the turns before it left (the last turn's own are removed).",
        "disk": "Before each restarted request every stored file is written back and dropped from the page cache "
                "(fsync, posix_fadvise DONTNEED); stored_pages_cached_before is the share still cached (mincore), "
                "which should be 0. The restored entry is then read on its own: disk_read by O_DIRECT (the bench's "
                "disk probe: 8 MiB reads, 8 threads), buffered_cold_read one read_bytes of the dropped file (what "
                "the stored tier does), read_decode_s StoredStates.get of the dropped file (read, checksum, "
                "decompress, decode onto the device).",
        "scaling": (f"TTFTs at {target} layers (ttft_at_layers_s): layers_s, the decoder layers' span (from the "
                    "first layer's start to the last one's end in each step of the prompt, on the device's clock: "
                    "runtime/bench/clock.py, LayerSpan), is the layers' work, scaled by "
                    f"{target} / {layers}; what the TTFT holds outside it, restore_s, saves_s and gc_s is what a "
                    "request does once (its prompt's digests and lookup, the embedding, the head, the token "
                    "chosen), added as it is; a stored hit's waits for bytes inside the layers count in both "
                    "layers_s and restore_s, so its scaled TTFT errs high there. The one PLE layer is timed "
                    "among the layers and scaled with them, high too. gc_s is "
                    "added as it is (a walk of the heap, whatever the layers); restore_s and saves_s move state bytes and are scaled by the state's bytes at the full layer count over its "
                    "bytes in the pack (at the row's prompt length): DeltaNet and attention layers' parts each by "
                    "their layer counts (layer_counts, the pack's attention pattern continued), PLE and MTP parts "
                    "as they are. A stored hit's read overlaps its prefill, so its scaled TTFT errs high: the "
                    "layers' work it hid is scaled as layer time, and the waits left as state bytes, where the "
                    "read at full layers would hide more of the (longer) prefill. The stored entry's file "
                    "scales by the same ratio; its target is max(1.0 s, its bytes at full layers / the O_DIRECT "
                    "disk rate + 0.2 s).") if scaled else
                   "Nothing scaled: --emulate-layers not given (or the pack's own count).",
        "budgets": f"Budgets typed for {target} layers, scaled to the pack's {layers}: {BUDGET_FORMULA}.",
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _bytes(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.1f} MB"


def _moved(store: dict | None) -> str:
    """A request's expert bytes to the device and its records read from disk (store_counts)."""
    return "-" if store is None else f"{store['bytes_host_to_device'] / 1e9:.2f} ({store['disk_reads']})"


def states_line(live: dict | None) -> str:
    """The live engine's prompt-state counts (PrefixCache.to_dict): how many of its saves it kept,
    and how many of its hits came from the disk (a live hit restored from there was not live)."""
    if not live:
        return "The live engine's prompt states: not reported."
    stored = live.get("stored") or {}
    return (f"The live engine's prompt states: {live['saved']} saved, {live['evicted']} evicted or dropped, "
            f"{live['live_entries']} live at the end ({_bytes(live['live_bytes'])}); {live['hits']} hits, "
            f"{live['stored_hits']} of them read from the disk; stored: {stored.get('writes', '-')} written, "
            f"{stored.get('skipped_writes', '-')} skipped.")


def markdown(report: dict) -> str:
    """The report's tables."""
    settings, budgets = report["settings"], report["budgets"]
    layers, target = budgets["pack_layers"], budgets["layers_typed_for"]
    scaled = layers != target
    machine = report["machine"]
    where = machine["gpu"]["name"] if machine["gpu"] else f"{machine['cpu']} ({machine['cpus_usable']} CPUs)"
    typed = " / ".join("-" if budgets["typed"][t] is None else f"{budgets['typed'][t] / (1 << 30):g} GiB"
                       for t in ("vram", "ram"))
    lines = [f"# Prompt-state reuse: {Path(settings['pack']).name} on {where}", "", f"`{report['command']}`", "",
             f"{layers}-layer pack" + (f", emulating {target} layers" if scaled else "")
             + f"; budgets (VRAM / RAM, full model) {typed}; hot set {settings['hot_set'] or '-'}; "
             f"replies {settings['reply_tokens']} tokens"
             + (", sent back as the tokens generated" if settings.get("reply_ids") else ", sent back as text")
             + ". Warm engines (load + warm-up): "
             + ", ".join(f"{name} {e['load_s']:.1f} + {e['warm_up_s']:.1f} s" for name, e in report["engines"].items())
             + f". Memory: {report['engines']['live'].get('memory', '-')}.", ""]
    head = f" TTFT at {target} layers s |" if scaled else ""
    rule = " --- |" if scaled else ""
    document = report.get("document")
    if document:
        lines += [f"## A follow-up on a {document['document_tokens']}-token document "
                  f"({document['question_tokens']}-token question)", "",
                  f"| request | prompt tokens | restored | new tokens | TTFT s | restore s | saves s | layers s | "
                  f"GC s (longest) | experts to device GB (records read from disk) | frames compiled, segments allocated |{head}",
                  f"| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |{rule}"]
        for name, key in (("first turn (document)", "first_turn"), ("follow-up, no reuse", "no_reuse"),
                          ("follow-up, live hit", "live_hit"),
                          ("another question, live hit", "live_hit_again"),
                          ("follow-up, stored hit after a restart", "stored_hit")):
            row = document[key]
            lines.append(f"| {name} | {row['prompt_tokens']} | {row['cached_tokens']} | {row['new_tokens']} | "
                         f"{_seconds(row['ttft_s'])} | {_seconds(row['restore_s'])} | {_seconds(row['saves_s'])} | "
                         f"{_seconds(row.get('layers_s'))} | {_seconds(row['gc_s'])} ({_seconds(row['gc_longest_s'])}) | {_moved(row.get('store'))} | "
                         f"{row.get('frames_compiled', '-')}, {row.get('device_segments_allocated', '-')} |"
                         + (f" {_seconds(row['ttft_at_layers_s'])} |" if scaled else ""))
        rounds = document["ab_rounds"]
        series: dict[tuple, list[dict]] = {}
        for row in rounds:
            series.setdefault(tuple(row.get("aside", SHORT_PROMPT_SETTINGS)), []).append(row)
        for aside, rows in series.items():
            changed = {name: value for name, value in document["short_prompt_settings"].items()
                       if value != document["short_prompt_defaults"][name]}
            named = ", ".join(f"{name} {value}" for name, value in changed.items()) or "none, both ways alike"
            lines += ["", f"Live hits with the engine's short-prompt settings as set ({named}) and with "
                      f"{', '.join(aside)} set aside (at their defaults), alternately, each a question of its own:", "",
                      f"| round | settings | new tokens | TTFT s | layers s |{head}", f"| --- | --- | --- | --- | --- |{rule}"]
            for row in rows:
                lines.append(f"| {row['round']} | {'as set' if row['as_set'] else 'aside'} | {row['new_tokens']} | "
                             f"{_seconds(row['ttft_s'])} | {_seconds(row.get('layers_s'))} |" + (f" {_seconds(row['ttft_at_layers_s'])} |" if scaled else ""))
            lines += ["", ab_summary(rows)]
        entry, goals = document.get("stored_entry"), document["targets"]
        lines.append("")
        met = lambda value: "-" if value is None else "met" if value else "missed"  # noqa: E731
        lines.append(f"Targets at {goals['layers']} layers: live hit <= {goals['live_hit_s']} s "
                     f"({met(goals['live_hit_met'])}), stored hit <= {_seconds(goals['stored_hit_s'])} s "
                     f"({met(goals['stored_hit_met'])}).")
        cached = document["stored_hit"]["stored_pages_cached_before"]
        lines.append(f"Stored files' pages in the page cache before the restart's request: "
                     f"{'unknown' if cached is None else f'{cached:.1%}'}.")
        lines.append(states_line(report.get("live")))
        if entry:
            disk = entry["disk_read"]
            lines.append(f"The restored entry ({entry['tokens']} tokens): {_bytes(entry['file_bytes'])} on disk "
                         f"({_bytes(entry['state_bytes'])} as a state"
                         + (f"; {_bytes(entry['file_bytes_at_layers'])} at {target} layers" if scaled else "")
                         + f"); the disk reads it at {disk['bytes_per_s'] / 1e9:.2f} GB/s "
                         f"({'O_DIRECT' if disk['o_direct'] else 'buffered: may be the page cache'}), a cold buffered "
                         f"read at {entry['buffered_cold_read_bytes_per_s'] / 1e9:.2f} GB/s; cold read + decode "
                         f"{entry['read_decode_s']:.3f} s.")
        lines.append("")
    turns = report.get("turns")
    if turns:
        head = (f" TTFT no reuse at {target} s | TTFT reuse at {target} s |" if scaled else "")
        lines += [f"## A {len(turns['rows'])}-turn conversation (~{settings['turn_tokens']} new tokens a turn)", "",
                  f"| turn | prompt tokens | restored | new tokens | TTFT no reuse s | TTFT reuse s |{head}",
                  f"| --- | --- | --- | --- | --- | --- |{rule * 2 if scaled else ''}"]
        for number, row in enumerate(turns["rows"], 1):
            lines.append(f"| {number} | {row['prompt_tokens']} | {row['cached_tokens']} | {row['new_tokens']} | "
                         f"{_seconds(row['ttft_no_reuse_s'])} | {_seconds(row['ttft_s'])} |"
                         + (f" {_seconds(row['ttft_no_reuse_at_layers_s'])} | {_seconds(row['ttft_at_layers_s'])} |"
                            if scaled else ""))
        restart = turns["restart"]
        lines += ["", f"After a restart (stored states only): the last turn restored {restart['cached_tokens']} of its "
                      f"{restart['prompt_tokens']} tokens, TTFT {restart['ttft_s']:.3f} s"
                      + (f" ({restart['ttft_at_layers_s']:.3f} s at {target} layers)" if scaled else "") + ".", ""]
    entry = report["entry_bytes"]
    lines.append(f"A saved state: {_bytes(entry['fixed'])} + {_bytes(entry['per_1k_tokens'])} per 1k tokens"
                 + (f" ({_bytes(entry['fixed_at_layers'])} + {_bytes(entry['per_1k_tokens_at_layers'])} at {target} "
                    "layers)" if scaled else "")
                 + f"; stored (zstd) {entry['stored_over_raw'] or 0:.2f} of that.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
