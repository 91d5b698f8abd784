"""Sparse MoE block: softmax router (fp32), top-k, renormalise; routed experts + gated shared expert.

Routed experts come from the block's expert source (runtime/experts.py), asked once per forward for
the union of the experts the router picked for the T tokens (T = 1 in decode, the whole prompt in
prefill: a long prompt touches most experts, so one layer-major pass moves each of them once).

With an `ExpertSlots` source the routed experts run as fused NVFP4 kernels over the source's bank:
    resident source (ResidentSlots): slots = slot_table[layer][experts] on the device, no host sync
    tiered store:                  one host sync for the expert ids (a prompt: their pair
                                   counts), the shared expert enqueued while the store lands the
                                   misses, then the kernels per chunk (a prompt's fill one float32
                                   buffer of (token, pick) rows, summed once: no sync a chunk);
                                   in decode the next layer's router, applied to this layer's
                                   input, names the experts to prefetch, started once this
                                   layer's own loads are queued (behind them in the store's
                                   lanes), so a guess's disk read runs while they land; with
                                   `read_ahead` the router of the layer after that names the
                                   records to read from disk into the host cache (a disk read
                                   takes about as long as a layer)
With an `ExpertFetcher` the dequantised weights run as plain linears, expert by expert.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing

import torch
import torch.nn.functional as F
from torch import nn

from flashpack.layout.model_config import TextConfig
from flashpack.runtime.experts import ExpertFetcher, ExpertSlots, ResidentSlots
from flashpack.runtime.kernels import moe_expert_pairs, moe_experts, router_top_k
from flashpack.runtime.kernels.dispatch import DECODE_MAX_TOKENS
from flashpack.runtime.model.host_copy import PinnedStaging
from flashpack.runtime.model.linear import DenseLinear, StackedLinear
from flashpack.runtime.model.norms import activation
from flashpack.runtime.weights import WeightSource

PREDICT_MAX_TOKENS = 4  # decode and speculative verification; a prompt fetches every expert anyway

# When a through-store decode layer starts prefetching the next layer's predicted experts: while its
# own loads land (True), or once they have (False, the order before session 11: the control that
# bench/h200.sh's `late-prefetch` stage benches)
PREFETCH_DURING_LOADS = True


class SparseMoE(nn.Module):
    def __init__(
        self, cfg: TextConfig, source: WeightSource, prefix: str, layer: int, fetcher: ExpertFetcher | ExpertSlots,
        dtype: torch.dtype, device,
    ):
        super().__init__()
        self.layer, self.fetcher, self.dtype, self.device = layer, fetcher, dtype, device
        self.slots = fetcher if isinstance(fetcher, ExpertSlots) else None
        self.resident = fetcher if isinstance(fetcher, ResidentSlots) else None
        self.staging = PinnedStaging()  # a step's slot codes cross from pinned buffers it reuses
        self.next_moe: SparseMoE | None = None  # whose experts to prefetch (set by the model)
        self.read_ahead = False  # read the layer after next's guessed disk records too (set by the model)
        self.routing_observer: Callable[[int, torch.Tensor], None] | None = None  # (layer, ids [T, k])
        self.num_experts, self.top_k, self.renormalise = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.act = activation(cfg.hidden_act)
        # The router [E, H], the shared expert's gate and up [I, H] and its gate [1, H]: one stacked
        # projection of the block input (the router also runs alone, to predict from a layer before).
        names = ("gate.weight", "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                 "shared_expert_gate.weight")
        self.in_proj = StackedLinear(source, [prefix + name for name in names], dtype, device)
        self.shared_down_proj = DenseLinear(source, prefix + "shared_expert.down_proj.weight", dtype, device)

    def gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (routing weights [T, k], expert ids [T, k], shared expert output [T, H])."""
        logits, gate, up, shared_gate = self.in_proj(x)
        weights, experts = self._top_k(logits)
        shared = torch.sigmoid(shared_gate) * self.shared_down_proj(self.act(gate) * up)
        return weights, experts, shared

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        return self._top_k(self.in_proj.part(x, 0))

    def _top_k(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = router_top_k(logits, self.top_k, self.renormalise)
        return weights.to(logits.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        # The shared expert is enqueued before the host blocks on expert copies: it runs meanwhile.
        weights, experts, shared = self.gate(x)
        if self.routing_observer is not None:
            self.routing_observer(self.layer, experts)
        if self.slots is None:
            return self._routed_dequantised(x, weights, experts) + shared
        if self.resident is not None:
            self.resident.record_use(self.layer, experts)
            slots = self.resident.slot_table[self.layer][experts]
            return self._experts(x, self.resident.bank, slots, weights, prompt=x.shape[0] > PREDICT_MAX_TOKENS) + shared
        return self.routed_from_store(x, weights, experts, self.predict_next(x), self.predict_far(x)) + shared

    def predict_next(self, x: torch.Tensor) -> torch.Tensor | None:
        """In decode, the experts the next layer's router picks from this layer's input [T, k]."""
        if self.next_moe is None or x.shape[0] > PREDICT_MAX_TOKENS:
            return None
        return self.next_moe.route(x)[1]

    def predict_far(self, x: torch.Tensor) -> torch.Tensor | None:
        """In decode through a store, the experts the layer after the next picks from this layer's
        input [T, k]: whose records to start reading from disk now."""
        if not self.read_ahead or self.next_moe is None:
            return None
        return self.next_moe.predict_next(x)

    def routed_from_store(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, predicted: torch.Tensor | None,
        far: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The routed experts through a tiered store: read the ids back in one transfer, start
        the loads, prefetch the predicted next-layer experts behind them (and read the layer after
        that's predicted `far` experts from disk), and run the kernels as the store lands the
        records (the decode graphs replay everything around this)."""
        if x.shape[0] > PREDICT_MAX_TOKENS:  # a prompt (no prediction): its pair counts, read back once
            counts = torch.bincount(experts.flatten(), minlength=self.num_experts).tolist()
            return self._prompt_from_slots(x, weights, experts, counts)
        # a few ids: one read-back, deduplicated on the host
        ids = torch.cat([part.flatten() for part in (experts, predicted, far) if part is not None]).tolist()
        mine, guessed = experts.numel(), experts.numel() + (0 if predicted is None else predicted.numel())
        host_experts, upcoming, farther = ids[:mine], ids[mine:guessed], ids[guessed:]
        wanted = sorted(set(host_experts))
        ahead = (self.next_moe.layer, sorted(set(upcoming))) if upcoming else None
        read_ahead = (self.next_moe.next_moe.layer, sorted(set(farther))) if farther else None
        if PREFETCH_DURING_LOADS:
            return self._routed_from_slots(x, weights, experts, wanted, host_experts, ahead, read_ahead)
        routed = self._routed_from_slots(x, weights, experts, wanted, host_experts, read_ahead=read_ahead)
        if ahead is not None:
            self.slots.prefetch(*ahead)
        return routed

    def _prompt_from_slots(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                           counts: list[int]) -> torch.Tensor:
        """A prompt's routed experts as the store streams them, chunk by chunk, without a host
        wait: each chunk's kernels fill the (token, pick) rows of its experts in one float32
        buffer, summed over the picks once the last chunk has run (as moe_experts sums)."""
        wanted = [expert for expert, count in enumerate(counts) if count]  # ascending
        pairs = None
        with closing(self.slots.stream(self.layer, wanted)) as chunks:  # closing releases the last chunk
            for chunk in chunks:
                if len(chunk) == len(wanted):  # the layer's share held them all: one call
                    slots = self._chunk_slots(chunk, experts)
                    return self._experts(x, self.slots.bank, slots, weights, prompt=True)
                if pairs is None:
                    pairs = torch.empty(experts.numel(), x.shape[1], dtype=torch.float32, device=x.device)
                bound = (sum(counts[handle.expert] for handle in chunk), len(chunk))
                moe_expert_pairs(x, self.slots.bank, self._chunk_slots(chunk, experts), weights, pairs, bound)
        return pairs.view(*experts.shape, x.shape[1]).sum(dim=1).to(x.dtype)

    def _chunk_slots(self, chunk, experts: torch.Tensor) -> torch.Tensor:
        """[T, k] bank rows of a chunk's experts, -1 where a pick is not in the chunk."""
        lookup = torch.full((self.num_experts,), -1, dtype=torch.int32)
        lookup[[handle.expert for handle in chunk]] = torch.tensor([handle.slot for handle in chunk],
                                                                   dtype=torch.int32)
        return self.staging.to_device(lookup, experts.device)[experts]

    def _routed_from_slots(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, wanted: list[int],
        host_experts: list[int], prefetch_after: tuple[int, list[int]] | None = None,
        read_ahead: tuple[int, list[int]] | None = None,
    ) -> torch.Tensor:
        """A decode step's routed experts; `host_experts`: `experts` read back, so the slots can be
        looked up on the host; `prefetch_after` and `read_ahead`: the next layer's and the one
        after's guesses, for the store."""
        out = None
        # closing releases the last chunk
        with closing(self.slots.stream(self.layer, wanted, prefetch_after, read_ahead)) as chunks:
            for chunk in chunks:
                part = self._decode_chunk(x, weights, experts, chunk, host_experts, whole=len(chunk) == len(wanted))
                out = part if out is None else out + part
        return out if out is not None else torch.zeros_like(x)

    def _decode_chunk(self, x, weights, experts, chunk, host_experts: list[int], whole: bool) -> torch.Tensor:
        """A decode step's picks from one chunk of the store's stream, at the full [T, k] shape: where
        the store lands a step's experts in several chunks (a slot share held by prefetches still
        loading), the picks this chunk lacks run on one of its rows at zero weight. One kernel build
        serves every chunk (a [n, 1] call would build again, seconds mid-decode), and the slots reach
        the device from pinned memory without the host waiting for the copy."""
        slot_of = {handle.expert: handle.slot for handle in chunk}
        held = [slot_of.get(expert, chunk[0].slot) for expert in host_experts]
        if whole:
            slots = self.staging.to_device(torch.tensor(held, dtype=torch.int32), x.device).view(experts.shape)
            return self._experts(x, self.slots.bank, slots, weights, prompt=False)
        present = [int(expert in slot_of) for expert in host_experts]
        codes = self.staging.to_device(torch.tensor([held, present], dtype=torch.int32), x.device)
        slots, present = codes[0].view(experts.shape), codes[1].view(experts.shape)
        return self._experts(x, self.slots.bank, slots, weights * present.to(weights.dtype), prompt=False)

    @staticmethod
    def _experts(x, bank, slots, weights, prompt: bool) -> torch.Tensor:
        """The fused kernels, chosen by what is computed, not by how many rows a call gets: a
        prompt's (token, expert) pairs take the grouped kernels however the store chunks them (and
        whatever it held), decode's the matrix-vector ones, so a budget changes no result."""
        return moe_experts(x, bank, slots, weights, decode_max_tokens=0 if prompt else DECODE_MAX_TOKENS)

    def _routed_dequantised(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        wanted = torch.unique(experts).tolist()  # ascending: the order transformers accumulates in
        fetched = self.fetcher.fetch(self.layer, wanted)
        out = torch.zeros_like(x)
        for expert in wanted:
            tokens, slot = torch.where(experts == expert)
            w = fetched[expert]
            h = x[tokens]
            h = self.act(F.linear(h, self._cast(w.gate))) * F.linear(h, self._cast(w.up))
            h = F.linear(h, self._cast(w.down)) * weights[tokens, slot, None]
            out.index_add_(0, tokens, h.to(out.dtype))
        return out

    def _cast(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(device=self.device, dtype=self.dtype)
