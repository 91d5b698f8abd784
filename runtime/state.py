"""Everything one sequence carries between engine steps, in one object with snapshot/restore.

    SequenceState
      position          tokens the backbone has consumed (the next token's position)
      deltanet[l]       DeltaNet layer l: causal-conv input tail + recurrent state (fp32)
      attention[l]      QSA layer l: roped K/V, raw indexer keys, pooled block keys;
                        MTP layers sit at l = num_hidden_layers + j, their length is the MTP position
      ple[l]            PLE layer l: last ngram_size - 1 tokens (CPU) + dilated-conv input tail
      mtp_input         the last position's pre-final-mixer streams, while the MTP head is run: its
                        input for the pair (streams, next token) whose token is not chosen yet

`snapshot()` returns a deep copy; `restore(snapshot)` copies it back (the snapshot stays usable),
which is what prompt reuse builds on. Speculative verification rolls back without a copy of the
whole state: `track()` before a step of a few tokens makes each layer keep what it needs to stand
after any of them (DeltaNet's recurrent state after each token and its conv window, PLE's token
history and conv window; attention caches only need their length), and `rewind(kept)` after the
step returns every part to just after the step's first `kept` tokens. Attention buffers grow by doubling,
so appending one token costs O(1) amortised, never a copy of the whole prefix. They start zeroed
and are restored in place when they have room, because CUDA-graph decode reads them whole
(masked past the length) at fixed addresses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flashpack.layout.model_config import TextConfig


@dataclass
class DeltaNetState:
    conv: torch.Tensor  # [2 * key_dim + value_dim, conv_kernel - 1] pre-conv q/k/v inputs
    recurrent: torch.Tensor  # [value_heads, key_head_dim, value_head_dim], fp32
    # while tracked (SequenceState.track): the step's recurrent state after each of its tokens
    # [T, ...] and its conv window [C, conv_kernel - 1 + T] (the tail before the step, then its inputs)
    tracked: bool = False
    positions: torch.Tensor | None = None
    window: torch.Tensor | None = None

    def copy(self) -> "DeltaNetState":
        return DeltaNetState(self.conv.clone(), self.recurrent.clone())

    def rewind(self, kept: int) -> None:
        """Back to just after the tracked step's first `kept` tokens. The step wrote the state after
        its last token into `recurrent` and `conv` in place (DeltaNet.forward, as its graphs
        replay it), so a step that keeps all its tokens copies nothing."""
        if self.positions is not None and kept < self.positions.shape[0]:
            self.recurrent.copy_(self.positions[kept - 1])
            self.conv.copy_(self.window[:, kept:kept + self.conv.shape[1]])
        self.tracked, self.positions, self.window = False, None, None


@dataclass
class PLEState:
    context: torch.Tensor  # int64 [ngram_size - 1] on CPU, EOS before the first token
    conv: torch.Tensor  # [hc * H, (ple_conv_kernel - 1) * ngram_size]
    # while tracked: the context then the step's tokens [ngram_size - 1 + T], and the conv window
    tracked: bool = False
    history: torch.Tensor | None = None
    window: torch.Tensor | None = None

    def copy(self) -> "PLEState":
        return PLEState(self.context.clone(), self.conv.clone())

    def at(self, kept: int) -> "PLEState":
        """While tracked: a copy of the state as it was after the step's first `kept` tokens (its
        n-gram context and conv input tail are slices of the step's history and window)."""
        return PLEState(self.history[kept:kept + self.context.shape[0]].clone(),
                        self.window[:, kept:kept + self.conv.shape[1]].clone())

    def rewind(self, kept: int) -> None:
        """As DeltaNetState.rewind: the step left its last token's context and conv tail, so
        keeping all its tokens copies nothing."""
        if self.history is not None:
            self.context = self.history[kept:kept + self.context.shape[0]].clone()
        if self.window is not None and kept < self.window.shape[1] - self.conv.shape[1]:
            self.conv.copy_(self.window[:, kept:kept + self.conv.shape[1]])
        self.tracked, self.history, self.window = False, None, None


class AttentionCache:
    """Per-position keys of one QSA layer, in buffers that grow by doubling."""

    def __init__(
        self, kv_heads: int, head_dim: int, index_dim: int, ratio: int,
        dtype: torch.dtype, device: torch.device | str, capacity: int = 64,
    ):
        self.ratio, self.length, self.blocks = ratio, 0, 0
        capacity = -(-max(capacity, ratio) // ratio) * ratio
        self._keys = torch.zeros(kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self._values = torch.zeros_like(self._keys)
        self._index_keys = torch.zeros(capacity, index_dim, dtype=dtype, device=device)
        self._block_keys = torch.zeros(capacity // ratio, index_dim, dtype=dtype, device=device)

    @property
    def keys(self) -> torch.Tensor:  # [kv_heads, length, head_dim], roped
        return self._keys[:, : self.length]

    @property
    def values(self) -> torch.Tensor:  # [kv_heads, length, head_dim]
        return self._values[:, : self.length]

    @property
    def index_keys(self) -> torch.Tensor:  # [length, index_dim], before norm and rope
        return self._index_keys[: self.length]

    @property
    def block_keys(self) -> torch.Tensor:  # [blocks, index_dim], pooled, normed, roped at block start
        return self._block_keys[: self.blocks]

    @property
    def capacity(self) -> int:
        return self._keys.shape[1]

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, index keys, block keys) at full capacity: what a decode graph reads and
        writes in place; entries past length / blocks are stale or zero."""
        return self._keys, self._values, self._index_keys, self._block_keys

    def reserve(self, length: int) -> None:
        """Room for `length` tokens (buffers may move: graphs bound to them must be captured again)."""
        if length > self.capacity:
            self._grow(length)

    def advance(self, new: int) -> None:
        """Count `new` tokens written in place (by a decode graph) and the blocks they complete."""
        self.length += new
        self.blocks = self.length // self.ratio

    def truncate(self, length: int) -> None:
        """Forget the tokens from `length` on (and the blocks they completed); their entries are
        overwritten by the next ones written."""
        if length < self.length:
            self.length = length
            self.blocks = min(self.blocks, length // self.ratio)

    def append(self, keys: torch.Tensor, values: torch.Tensor, index_keys: torch.Tensor) -> None:
        """keys, values [kv_heads, T, head_dim]; index_keys [T, index_dim]."""
        new = keys.shape[1]
        if self.length + new > self.capacity:
            self._grow(self.length + new)
        end = self.length + new
        self._keys[:, self.length:end] = keys
        self._values[:, self.length:end] = values
        self._index_keys[self.length:end] = index_keys
        self.length = end

    def append_blocks(self, block_keys: torch.Tensor) -> None:
        """Pooled keys of the next complete blocks, [n, index_dim] (capacity follows the tokens)."""
        end = self.blocks + block_keys.shape[0]
        self._block_keys[self.blocks:end] = block_keys
        self.blocks = end

    def _grow(self, needed: int) -> None:
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        self._keys = _resized(self._keys, 1, capacity, self.length)
        self._values = _resized(self._values, 1, capacity, self.length)
        self._index_keys = _resized(self._index_keys, 0, capacity, self.length)
        self._block_keys = _resized(self._block_keys, 0, capacity // self.ratio, self.blocks)

    def load(self, other: "AttentionCache") -> None:
        """Become a copy of `other`, in this cache's own buffers when they have room."""
        if other.length > self.capacity:
            self._grow(other.length)  # on this cache's device, wherever `other` lives (a host copy)
        # head by head: a head's filled keys are one contiguous run, where all heads' together are
        # strided whenever the buffer is longer than its length (a snapshot's rounds up to the
        # block ratio), and a strided pinned source is gathered into pageable memory first and
        # crosses the link at a fraction of its rate; SequenceState.restore waits for the copies
        for head in range(other.keys.shape[0]):
            self._keys[head, : other.length].copy_(other.keys[head], non_blocking=True)
            self._values[head, : other.length].copy_(other.values[head], non_blocking=True)
        self._index_keys[: other.length].copy_(other.index_keys, non_blocking=True)
        self._block_keys[: other.blocks].copy_(other.block_keys, non_blocking=True)
        self.length, self.blocks = other.length, other.blocks

    def prefix(self, length: int) -> "AttentionCache":
        """A deep copy of the cache as it stood after its first `length` tokens: their keys and the
        blocks they complete (a causal layer's earlier keys never change)."""
        if length > self.length:
            raise ValueError(f"a prefix of {length} tokens of a cache of {self.length}")
        clone = AttentionCache.__new__(AttentionCache)
        clone.ratio, clone.length, clone.blocks = self.ratio, length, min(self.blocks, length // self.ratio)
        capacity = -(-max(length, self.ratio) // self.ratio) * self.ratio
        clone._keys = _resized(self._keys, 1, capacity, length)
        clone._values = _resized(self._values, 1, capacity, length)
        clone._index_keys = _resized(self._index_keys, 0, capacity, length)
        clone._block_keys = _resized(self._block_keys, 0, capacity // self.ratio, clone.blocks)
        return clone

    def copy(self) -> "AttentionCache":
        """A deep copy holding only the filled part (it grows again on append)."""
        return self.prefix(self.length)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._keys, self._values, self._index_keys, self._block_keys))

    @classmethod
    def filled(cls, keys: torch.Tensor, values: torch.Tensor, index_keys: torch.Tensor, block_keys: torch.Tensor,
               ratio: int, length: int, blocks: int, device: torch.device | str) -> "AttentionCache":
        """A cache holding exactly these filled parts (a decoded stored state), on `device`."""
        cache = cls.__new__(cls)
        cache.ratio, cache.length, cache.blocks = ratio, length, blocks
        capacity = -(-max(length, ratio) // ratio) * ratio
        cache._keys = _resized(keys.to(device), 1, capacity, length)
        cache._values = _resized(values.to(device), 1, capacity, length)
        cache._index_keys = _resized(index_keys.to(device), 0, capacity, length)
        cache._block_keys = _resized(block_keys.to(device), 0, capacity // ratio, blocks)
        return cache

    @classmethod
    def viewing(cls, keys: torch.Tensor, values: torch.Tensor, index_keys: torch.Tensor, block_keys: torch.Tensor,
                ratio: int, length: int, blocks: int) -> "AttentionCache":
        """A cache whose buffers are exactly these filled parts, not copied (a host entry read from
        disk into pinned memory: restored from, never appended to)."""
        cache = cls.__new__(cls)
        cache.ratio, cache.length, cache.blocks = ratio, length, blocks
        cache._keys, cache._values, cache._index_keys, cache._block_keys = keys, values, index_keys, block_keys
        return cache

    def to(self, device: torch.device, pin: bool = False, allocate: Allocate | None = None) -> "AttentionCache":
        """A copy on `device` (pinned host memory with `pin`; `allocate`: SequenceState.to)."""
        moved = AttentionCache.__new__(AttentionCache)
        moved.ratio, moved.length, moved.blocks = self.ratio, self.length, self.blocks
        moved._keys, moved._values, moved._index_keys, moved._block_keys = (
            _moved(t, device, pin, allocate) for t in self.buffers())
        return moved


# (shape, dtype) -> an empty pinned host tensor to copy into (a range of runtime/engine/pinned_arena.py's)
Allocate = Callable[[torch.Size, torch.dtype], torch.Tensor]


def _moved(tensor: torch.Tensor, device: torch.device, pin: bool, allocate: Allocate | None = None) -> torch.Tensor:
    if allocate is not None and device.type == "cpu":
        return allocate(tensor.shape, tensor.dtype).copy_(tensor, non_blocking=True)
    if pin and device.type == "cpu" and tensor.is_cuda:
        # straight into pinned memory, queued on the current stream: the caller synchronizes
        # before the host reads it (a pageable copy then pin_memory would copy twice, and wait)
        moved = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return moved.copy_(tensor, non_blocking=True)
    moved = tensor.to(device)
    return moved.pin_memory() if pin and moved.device.type == "cpu" else moved


def _resized(buffer: torch.Tensor, dim: int, size: int, filled: int) -> torch.Tensor:
    shape = list(buffer.shape)
    shape[dim] = size
    out = torch.empty(shape, dtype=buffer.dtype, device=buffer.device)
    out.narrow(dim, 0, filled).copy_(buffer.narrow(dim, 0, filled))
    out.narrow(dim, filled, size - filled).zero_()  # what lies past the filled part is zeros
    return out


@dataclass
class SequenceState:
    position: int
    deltanet: dict[int, DeltaNetState]
    attention: dict[int, AttentionCache]
    ple: dict[int, PLEState]
    mtp_input: torch.Tensor | None = None  # [1, hc * H]
    _tracked_from: tuple[int, dict[int, int]] | None = None  # (position, attention lengths) at track()
    # A saved state still arriving (runtime/engine/arriving_state.py): its layers are restored as the
    # model reaches them (`arrive`), the rest before anything else reads the state (`arrive_all`).
    arriving: object | None = field(default=None, repr=False, compare=False)

    @classmethod
    def empty(cls, cfg: TextConfig, dtype: torch.dtype, device: torch.device | str) -> "SequenceState":
        """Fresh state for `cfg`'s backbone and MTP layers, before the first token."""
        conv_dim = 2 * cfg.linear_key_dim + cfg.linear_value_dim
        deltanet, attention, ple = {}, {}, {}
        for layer in range(cfg.num_hidden_layers):
            if cfg.is_linear(layer):
                deltanet[layer] = DeltaNetState(
                    conv=torch.zeros(conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=dtype, device=device),
                    recurrent=torch.zeros(
                        cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                        dtype=torch.float32, device=device,
                    ),
                )
            else:
                attention[layer] = _attention_cache(cfg, dtype, device)
            if cfg.ple_index(layer) is not None:
                ple[layer] = PLEState(
                    context=torch.full((cfg.ngram_size - 1,), cfg.eos_token_id, dtype=torch.int64),
                    conv=torch.zeros(
                        cfg.hc_count * cfg.hidden_size, (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size,
                        dtype=dtype, device=device,
                    ),
                )
        for mtp_layer in range(cfg.mtp_num_hidden_layers):
            attention[cfg.num_hidden_layers + mtp_layer] = _attention_cache(cfg, dtype, device)
        return cls(position=0, deltanet=deltanet, attention=attention, ple=ple)

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` positions in every attention cache, so none has to grow (and move, which
        makes decode graphs bound to it be captured again) within a sequence of that length."""
        for cache in self.attention.values():
            cache.reserve(tokens)

    @property
    def tracked(self) -> bool:
        return self._tracked_from is not None

    def track(self) -> None:
        """Keep, through the next step, what `rewind` needs to stand after any of its tokens."""
        self._tracked_from = (self.position, {layer: cache.length for layer, cache in self.attention.items()})
        for part in (*self.deltanet.values(), *self.ple.values()):
            part.tracked = True

    def rewind(self, kept: int) -> None:
        """After a tracked step: back to just after its first `kept` tokens (1 <= kept <= its length).
        Attention caches the step did not write (the MTP head's) stay as they are."""
        if self._tracked_from is None:
            raise RuntimeError("rewind without a tracked step")
        position, lengths = self._tracked_from
        if not 1 <= kept <= self.position - position:
            raise ValueError(f"rewind keeps 1..{self.position - position} tokens of the step, not {kept}")
        for part in (*self.deltanet.values(), *self.ple.values()):
            part.rewind(kept)
        for layer, cache in self.attention.items():
            cache.truncate(lengths[layer] + kept)
        self.position, self._tracked_from = position + kept, None

    def _untrack(self) -> None:
        self._tracked_from = None
        for part in self.deltanet.values():
            part.tracked, part.positions, part.window = False, None, None
        for part in self.ple.values():
            part.tracked, part.history, part.window = False, None, None

    def snapshot(self) -> "SequenceState":
        """A deep copy, independent of this state from now on."""
        return SequenceState(
            position=self.position,
            deltanet={layer: s.copy() for layer, s in self.deltanet.items()},
            attention={layer: s.copy() for layer, s in self.attention.items()},
            ple={layer: s.copy() for layer, s in self.ple.items()},
            mtp_input=None if self.mtp_input is None else self.mtp_input.clone(),
        )

    def restore(self, snapshot: "SequenceState") -> None:
        """Become a deep copy of `snapshot` (which stays valid for further restores).

        State is copied into this state's own buffers (attention caches too, while they have
        room), so CUDA graphs captured against them (runtime/engine/decode_graphs.py) stay valid
        across a rollback. A state still arriving is let go first."""
        self.begin_restore(snapshot)
        for layer in snapshot.layers():
            self.restore_layer(snapshot, layer)
        self.end_restore(snapshot)

    def begin_restore(self, snapshot: "SequenceState") -> None:
        """The first part of `restore`: the position; each layer's parts follow (`restore_layer`),
        then `end_restore`."""
        if self.arriving is not None:
            arriving, self.arriving = self.arriving, None
            arriving.abandon()
        self.position = snapshot.position
        self.mtp_input = None
        self._untrack()  # a step cut short while tracked (an error mid-verify) leaves nothing behind

    def restore_layer(self, snapshot: "SequenceState", layer: int) -> None:
        """`snapshot`'s parts of `layer` copied in. The copies are queued, not waited for one by one
        (a wait each holds the host ~46 times on 16 layers): `end_restore` waits for them once."""
        if layer in snapshot.deltanet:
            saved = snapshot.deltanet[layer]
            self.deltanet[layer].conv.copy_(saved.conv, non_blocking=True)
            self.deltanet[layer].recurrent.copy_(saved.recurrent, non_blocking=True)
        if layer in snapshot.ple:
            saved = snapshot.ple[layer]
            self.ple[layer].context = saved.context.clone()
            self.ple[layer].conv.copy_(saved.conv, non_blocking=True)
        if layer in snapshot.attention:
            self.attention[layer].load(snapshot.attention[layer])

    def end_restore(self, snapshot: "SequenceState") -> None:
        """The last part of `restore`: the MTP head's input, and a host snapshot's copies waited
        for, as its memory may be reused (another entry's, in the pinned arena) once this returns."""
        device = self._device()
        self.mtp_input = None if snapshot.mtp_input is None else snapshot.mtp_input.to(device, copy=True, non_blocking=True)
        if device.type == "cuda" and snapshot._device().type == "cpu":
            torch.cuda.current_stream(device).synchronize()

    def checkpoint_attention(self, position: int, backbone_layers: int) -> dict[int, "AttentionCache"]:
        """Copies of the attention caches as a checkpoint at `position` holds them: the backbone's
        first `position` keys (a causal layer's earlier keys never change); the MTP head's caches
        (layers past the backbone's) empty, for its drafter to fill where it is caught up
        (MTPDrafter.observe), else the checkpoint gets no MTP drafts."""
        return {layer: cache.prefix(position if layer < backbone_layers else 0)
                for layer, cache in self.attention.items()}

    def layers(self) -> list[int]:
        """Every layer this state holds a part of, ascending (the MTP head's after the backbone's)."""
        return sorted({*self.deltanet, *self.ple, *self.attention})

    def arrive(self, layer: int) -> None:
        """Before `layer` runs: its parts of a state still arriving, restored once its bytes are in."""
        if self.arriving is not None:
            self.arriving.layer(layer)

    def arrive_all(self) -> None:
        """Every part of a state still arriving restored (waiting for its last bytes): before
        anything reads the state whole."""
        if self.arriving is not None:
            arriving, self.arriving = self.arriving, None
            arriving.finish()

    def to(self, device: torch.device, pin: bool = False, allocate: Allocate | None = None) -> "SequenceState":
        """A copy on `device` (pinned host memory with `pin`: a GPU copies it back asynchronously).
        From a GPU to pinned memory the copies are queued on the current stream, not waited for.
        `allocate(shape, dtype)`: the host tensors to copy into, one for each of `device_tensors()`
        (else they are allocated, pinned with `pin`)."""
        return SequenceState(
            position=self.position,
            deltanet={layer: DeltaNetState(_moved(s.conv, device, pin, allocate),
                                           _moved(s.recurrent, device, pin, allocate))
                      for layer, s in self.deltanet.items()},
            attention={layer: cache.to(device, pin, allocate) for layer, cache in self.attention.items()},
            ple={layer: PLEState(s.context.clone(), _moved(s.conv, device, pin, allocate))
                 for layer, s in self.ple.items()},
            mtp_input=None if self.mtp_input is None else _moved(self.mtp_input, device, pin, allocate),
        )

    def device_tensors(self) -> list[torch.Tensor]:
        """Every tensor `to` moves (all but the PLE token contexts, which live on the host)."""
        found = [t for s in self.deltanet.values() for t in (s.conv, s.recurrent)]
        found += [s.conv for s in self.ple.values()]
        found += [t for cache in self.attention.values() for t in cache.buffers()]
        return found + ([] if self.mtp_input is None else [self.mtp_input])

    def _device(self) -> torch.device:
        return next(iter(self.attention.values())).keys.device

    def nbytes(self) -> int:
        tensors = self.device_tensors() + [s.context for s in self.ple.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(cfg: TextConfig, dtype: torch.dtype, tokens: int) -> int:
    """The bytes of a state holding `tokens` positions (its buffers at that capacity, built on the
    meta device: nothing is allocated). The MTP head's cache is counted whether or not the head
    runs: an upper bound on what a saved state of that many tokens holds."""
    state = SequenceState.empty(cfg, dtype, "meta")
    state.reserve(tokens)
    return state.nbytes()


def _attention_cache(cfg: TextConfig, dtype: torch.dtype, device: torch.device | str) -> AttentionCache:
    return AttentionCache(
        cfg.num_key_value_heads, cfg.head_dim, cfg.indexer_head_dim, cfg.indexer_compress_ratio, dtype, device,
    )
