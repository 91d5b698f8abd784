"""How a MoE block's routed experts run from an expert source: the engine's RoutedExperts.

    routed_experts(source, ...) picks one by what the source is:
    ExpertFetcher      DequantisedExperts (runtime/model): dequantised weights as plain linears;
                       StackedExperts where a layer's experts are few and small (the demo model):
                       a step of a few tokens runs every expert of the layer at once
    ResidentSlots      BankExperts: every expert resident in a device bank; the slots are looked
                       up on the device (slot_table[layer][experts]), no host sync, which CUDA
                       graphs need; the fused NVFP4 kernels run over the bank
    ExpertSlots        StoreExperts: a tiered store. One host sync for the expert ids (a prompt:
                       their pair counts), the loads started while the shared expert (enqueued
                       before) runs, then the kernels per chunk as the store lands the records (a
                       prompt's fill one float32 buffer of (token, pick) rows, summed once: no sync
                       a chunk). In decode the next layer's router, applied to this layer's input,
                       names the experts to prefetch, started once this layer's own loads are
                       queued (behind them in the store's lanes), so a guess's disk read runs while
                       they land; with `read_ahead` the router of the layer after that names the
                       records to read from disk into the host cache (a disk read takes about as
                       long as a layer).

The fused kernels are chosen by what is computed, not by how many rows a call gets: a prompt's
(token, expert) pairs take the grouped kernels however the store chunks them (and whatever it
held), decode's the matrix-vector ones, so a budget changes no result.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashpack.layout.model_config import TextConfig
from flashpack.runtime.experts import ExpertFetcher, ExpertSlots, ResidentSlots
from flashpack.runtime.kernels import moe_expert_pairs, moe_experts
from flashpack.runtime.kernels.dispatch import DECODE_MAX_TOKENS
from flashpack.runtime.model.host_copy import PinnedStaging
from flashpack.runtime.model.norms import activation
from flashpack.runtime.model.routed_experts import DequantisedExperts, RoutedExperts

PREDICT_MAX_TOKENS = 4  # decode and speculative verification; a prompt fetches every expert anyway
# A layer's experts run stacked (StackedExperts) where all of them together hold at most this many
# parameters: the demo model's 32 experts hold 0.8 M; the real model's 512 hold thousands of times more.
STACKED_EXPERTS_MAX_PARAMS = 1 << 22
STACKED_MAX_TOKENS = 17  # a decode step or a checked step (MAX_DRAFT_TOKENS drafts and the token before them)

Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # x [T, H] -> (weights, ids) [T, k]


def routed_experts(source, cfg: TextConfig, dtype: torch.dtype, device, prediction: "Prediction | None" = None
                   ) -> RoutedExperts:
    """The RoutedExperts for `source`; `prediction` (a tiered store's decode prefetch) applies to
    StoreExperts only."""
    if isinstance(source, ResidentSlots):
        return BankExperts(source)
    if isinstance(source, ExpertSlots):
        return StoreExperts(source, cfg.num_experts, prediction or Prediction())
    if isinstance(source, ExpertFetcher):
        act = activation(cfg.hidden_act)
        if cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.hidden_size <= STACKED_EXPERTS_MAX_PARAMS:
            return StackedExperts(source, act, dtype, device, cfg.num_experts)
        return DequantisedExperts(source, act, dtype, device)
    raise TypeError(f"not an expert source: {type(source).__name__}")


class StackedExperts(DequantisedExperts):
    """DequantisedExperts for layers of few, small experts: a step of up to STACKED_MAX_TOKENS
    tokens runs every expert of the layer at once, from the layer's experts stacked on first use
    (gate and up as one [2 E I, H] matrix, down as one [H, E I]); each expert's hidden units are
    scaled by its routing weight (0 where the token did not pick it) before the down projection sums
    them. Three matrix products in place of some eight small operations an expert: a speculative
    step's few tokens pick the union of their experts (about 12 of the demo model's 32 at five
    tokens), which the expert loop pays for one by one. It computes E / k times the products of the
    picked experts, so prompts, whose tokens pick every expert anyway, keep the loop."""

    def __init__(self, fetcher, act, dtype: torch.dtype, device, num_experts: int):
        super().__init__(fetcher, act, dtype, device)
        self.num_experts = num_experts
        self._stacked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > STACKED_MAX_TOKENS:
            return super().__call__(layer, x, weights, experts)
        gate_up, down = self._layer(layer)
        tokens, count = x.shape[0], self.num_experts
        gate, up = F.linear(x, gate_up).view(tokens, 2, count, -1).unbind(1)  # [T, E, I] each
        routing = torch.zeros(tokens, count, dtype=x.dtype, device=x.device)
        routing.scatter_(1, experts, weights.to(x.dtype))  # a token's k picks are distinct
        hidden = self.act(gate) * up * routing[:, :, None]
        return F.linear(hidden.reshape(tokens, -1), down)

    def _layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        stacked = self._stacked.get(layer)
        if stacked is None:
            fetched = self.fetcher.fetch(layer, list(range(self.num_experts)))
            ordered = [fetched[e] for e in range(self.num_experts)]
            gate_up = torch.cat([torch.cat([w.gate for w in ordered]), torch.cat([w.up for w in ordered])])
            down = torch.cat([w.down for w in ordered], dim=1)  # [H, E I]
            stacked = self._stacked[layer] = (self._cast(gate_up), self._cast(down))
        return stacked


def fused_experts(x, bank, slots, weights, prompt: bool) -> torch.Tensor:
    """The fused NVFP4 kernels over `bank`'s rows `slots` [T, k]."""
    return moe_experts(x, bank, slots, weights, decode_max_tokens=0 if prompt else DECODE_MAX_TOKENS)


class BankExperts:
    """Every expert resident in one device bank."""

    def __init__(self, source: ResidentSlots):
        self.source = source

    def __call__(self, layer: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        self.source.record_use(layer, experts)
        slots = self.source.slot_table[layer][experts]
        return fused_experts(x, self.source.bank, slots, weights, prompt=x.shape[0] > PREDICT_MAX_TOKENS)


@dataclass(frozen=True)
class Prediction:
    """What a decode layer through a store asks for ahead (EngineConfig's fields of the same names)."""

    prefetch: bool = True  # the next layer's predicted experts
    read_ahead: bool = True  # the layer after next's predicted disk records, into the host cache
    prefetch_during_loads: bool = True  # started while this layer's own loads land, not after
    prompt_max_tokens: int = 0  # a prompt step of up to this many tokens prefetches the next layer's too


class StoreExperts:
    """Routed experts through a tiered store (an ExpertSlots source that is not resident)."""

    def __init__(self, source: ExpertSlots, num_experts: int, prediction: Prediction):
        self.source, self.num_experts, self.prediction = source, num_experts, prediction
        self.routers: dict[int, Router] = {}  # layer -> its router, for predictions (`predict_with`)
        self._staging: dict[int, PinnedStaging] = {}  # a layer's slot codes cross from pinned buffers it reuses

    def predict_with(self, routers: dict[int, Router]) -> None:
        """The decoder layers' routers, by layer: decode predicts layer L + 1's (and L + 2's)
        experts from layer L's input with them. Without them (or with prefetch off) nothing is
        predicted."""
        self.routers = dict(routers) if self.prediction.prefetch else {}

    def predict_next(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """In decode, and in a prompt step of up to `Prediction.prompt_max_tokens` tokens, the
        experts layer + 1's router picks from layer's input x [T, H]: ids [T, k]."""
        tokens = x.shape[0]
        if tokens > PREDICT_MAX_TOKENS and tokens > self.prediction.prompt_max_tokens:
            return None
        return self.predicted(layer, x, 1)

    def predict_far(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """In decode, the experts layer + 2 picks from layer's input: whose records to start
        reading from disk now."""
        return None if x.shape[0] > PREDICT_MAX_TOKENS else self.predicted(layer, x, 2)

    def predicted(self, layer: int, x: torch.Tensor, ahead: int) -> torch.Tensor | None:
        """The experts layer + `ahead`'s router picks from layer's input x [T, H] (ids [T, k]), for
        a step of decode's kind whatever its rows (a checked step's): the next layer's to prefetch,
        the one after's (with `read_ahead`) to read from disk into the host cache. None: no router
        (the last layers, prefetch off), or read-ahead off."""
        following = self.routers.get(layer + ahead)
        if following is None or (ahead > 1 and not self.prediction.read_ahead):
            return None
        return following(x)[1]

    def __call__(self, layer: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return self.from_store(layer, x, weights, experts, self.predict_next(layer, x), self.predict_far(layer, x))

    def from_store(
        self, layer: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
        predicted: torch.Tensor | None, far: torch.Tensor | None = None, prompt: bool | None = None,
    ) -> torch.Tensor:
        """Read the ids back in one transfer, start the loads, prefetch the predicted next-layer
        experts behind them (and read the `far` experts of the layer after from disk), and run the
        kernels as the store lands the records (the decode graphs replay everything around this).
        `prompt`: a prompt's kernels or decode's (None: a prompt past PREDICT_MAX_TOKENS rows; a
        checked step's rows take decode's, whatever their number, as one-token steps would)."""
        if prompt is None:
            prompt = x.shape[0] > PREDICT_MAX_TOKENS
        if prompt:  # its pair counts (and the predicted next layer's), read back at once
            found = [experts] if predicted is None else [experts, predicted]
            counts = torch.cat([torch.bincount(ids.flatten(), minlength=self.num_experts) for ids in found]).tolist()
            ahead = None
            if predicted is not None:  # the most picked first: a share smaller than the guess keeps those
                guessed = counts[self.num_experts:]
                ahead = (layer + 1, sorted((e for e, n in enumerate(guessed) if n), key=lambda e: -guessed[e]))
            return self._prompt(layer, x, weights, experts, counts[:self.num_experts], ahead)
        # a few ids: one read-back, deduplicated on the host
        ids = torch.cat([part.flatten() for part in (experts, predicted, far) if part is not None]).tolist()
        mine, guessed = experts.numel(), experts.numel() + (0 if predicted is None else predicted.numel())
        host_experts, upcoming, farther = ids[:mine], ids[mine:guessed], ids[guessed:]
        wanted = sorted(set(host_experts))
        ahead = (layer + 1, sorted(set(upcoming))) if upcoming else None
        read_ahead = (layer + 2, sorted(set(farther))) if farther else None
        if self.prediction.prefetch_during_loads:
            return self._decode(layer, x, weights, experts, wanted, host_experts, ahead, read_ahead)
        routed = self._decode(layer, x, weights, experts, wanted, host_experts, read_ahead=read_ahead)
        if ahead is not None:
            self.source.prefetch(*ahead)
        return routed

    def _prompt(self, layer: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                counts: list[int], ahead: tuple[int, list[int]] | None = None) -> torch.Tensor:
        """A prompt's routed experts as the store streams them, chunk by chunk, without a host
        wait: each chunk's kernels fill the (token, pick) rows of its experts in one float32
        buffer, summed over the picks once the last chunk has run (as moe_experts sums).
        `ahead` (layer, experts): prefetched once this layer's own loads are all queued, so the
        link works through the next layer's mixer and read-back, which a short prompt's layer
        would otherwise wait for with nothing loading."""
        wanted = [expert for expert, count in enumerate(counts) if count]  # ascending
        pairs = out = None
        with closing(self.source.stream(layer, wanted)) as chunks:  # closing releases the last chunk
            for chunk in chunks:
                if len(chunk) == len(wanted):  # the layer's share held them all: one call
                    out = fused_experts(x, self.source.bank, self._chunk_slots(layer, chunk, experts), weights,
                                        prompt=True)
                    break
                if pairs is None:
                    pairs = torch.empty(experts.numel(), x.shape[1], dtype=torch.float32, device=x.device)
                bound = (sum(counts[handle.expert] for handle in chunk), len(chunk))
                moe_expert_pairs(x, self.source.bank, self._chunk_slots(layer, chunk, experts), weights, pairs, bound)
        if ahead is not None:
            self.source.prefetch(*ahead)
        return out if out is not None else pairs.view(*experts.shape, x.shape[1]).sum(dim=1).to(x.dtype)

    def _chunk_slots(self, layer: int, chunk, experts: torch.Tensor) -> torch.Tensor:
        """[T, k] bank rows of a chunk's experts, -1 where a pick is not in the chunk."""
        lookup = torch.full((self.num_experts,), -1, dtype=torch.int32)
        lookup[[handle.expert for handle in chunk]] = torch.tensor([handle.slot for handle in chunk],
                                                                   dtype=torch.int32)
        return self._staging_of(layer).to_device(lookup, experts.device)[experts]

    def _decode(
        self, layer: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, wanted: list[int],
        host_experts: list[int], prefetch_after: tuple[int, list[int]] | None = None,
        read_ahead: tuple[int, list[int]] | None = None,
    ) -> torch.Tensor:
        """A decode step's routed experts; `host_experts`: `experts` read back, so the slots can be
        looked up on the host; `prefetch_after` and `read_ahead`: the next layer's and the one
        after's guesses, for the store."""
        out = None
        # closing releases the last chunk
        with closing(self.source.stream(layer, wanted, prefetch_after, read_ahead)) as chunks:
            for chunk in chunks:
                part = self._decode_chunk(layer, x, weights, experts, chunk, host_experts,
                                          whole=len(chunk) == len(wanted))
                out = part if out is None else out + part
        return out if out is not None else torch.zeros_like(x)

    def _decode_chunk(self, layer: int, x, weights, experts, chunk, host_experts: list[int], whole: bool
                      ) -> torch.Tensor:
        """A decode step's picks from one chunk of the store's stream, at the full [T, k] shape: where
        the store lands a step's experts in several chunks (a slot share held by prefetches still
        loading), the picks this chunk lacks run on one of its rows at zero weight. One kernel build
        serves every chunk (a [n, 1] call would build again, seconds mid-decode), and the slots reach
        the device from pinned memory without the host waiting for the copy."""
        staging = self._staging_of(layer)
        slot_of = {handle.expert: handle.slot for handle in chunk}
        held = [slot_of.get(expert, chunk[0].slot) for expert in host_experts]
        if whole:
            slots = staging.to_device(torch.tensor(held, dtype=torch.int32), x.device).view(experts.shape)
            return fused_experts(x, self.source.bank, slots, weights, prompt=False)
        present = [int(expert in slot_of) for expert in host_experts]
        codes = staging.to_device(torch.tensor([held, present], dtype=torch.int32), x.device)
        slots, present = codes[0].view(experts.shape), codes[1].view(experts.shape)
        return fused_experts(x, self.source.bank, slots, weights * present.to(weights.dtype), prompt=False)

    def _staging_of(self, layer: int) -> PinnedStaging:
        staging = self._staging.get(layer)
        if staging is None:
            staging = self._staging[layer] = PinnedStaging()
        return staging
