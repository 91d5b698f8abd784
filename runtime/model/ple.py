"""PLE: hashed n-gram embeddings injected into every residual stream (layers in `ple_layer_ids`).

Per token, the bigram and trigram ending at it are hashed by `heads_per_ngram` heads each (odd
per-layer multipliers from splitmix64, XOR-combined, modulo a prime per head); the rows come from
the WeightSource one batch at a time, never as a table. N-grams stop at document boundaries: a
token more than `shift` back counts only if no EOS sits strictly between it and the current token
(before the first token, EOS fills in). The concatenated rows pass a gated projection and a dilated
depthwise conv (dilation = ngram_size) and the result is added to the streams.

State per PLE layer (in `PLEState`): the last ngram_size - 1 tokens and the conv's input tail.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flashpack.layout.model_config import TextConfig
from flashpack.runtime.model.host_copy import PinnedStaging
from flashpack.runtime.model.linear import DenseLinear
from flashpack.runtime.model.norms import RMSNorm
from flashpack.runtime.state import PLEState
from flashpack.runtime.weights import WeightSource, load_dense

def shift_within_document(tokens: torch.Tensor, shift: int, eos: int) -> torch.Tensor:
    """tokens int64 [L] -> the token `shift` back at each position, or EOS across a document start."""
    if shift == 0:
        return tokens
    positions = torch.arange(tokens.shape[0], device=tokens.device)
    eos_positions = torch.where(tokens == eos, positions, -1)
    last_eos_before = torch.cat([eos_positions.new_full((1,), -1), torch.cummax(eos_positions, 0).values[:-1]])
    valid = (positions - last_eos_before - 1 >= shift) & (positions >= shift)
    return torch.where(valid, tokens[(positions - shift).clamp_min(0)], eos)


class NGramHasher:
    """Global PLE row ids of every hash head for each token."""

    def __init__(self, cfg: TextConfig, ple_index: int):
        self.ngram_size, self.per_order, self.eos = cfg.ngram_size, cfg.heads_per_ngram, cfg.eos_token_id
        self.multipliers = cfg.ple_multipliers(ple_index)
        self.head_sizes, self.head_offsets = cfg.ple_head_vocab_sizes(ple_index), cfg.ple_head_offsets(ple_index)
        self.vocab_sizes = torch.tensor(self.head_sizes, dtype=torch.int64)
        self.offsets = torch.tensor(self.head_offsets, dtype=torch.int64)

    def rows(self, history: torch.Tensor, new: int) -> torch.Tensor:
        """history int64 [ngram_size - 1 + new] (CPU) -> row ids [new, ngram_heads] for the last `new` tokens."""
        shifted = [shift_within_document(history, s, self.eos) * self.multipliers[s] for s in range(self.ngram_size)]
        blocks = []
        for order in range(2, self.ngram_size + 1):
            mixed = shifted[0]
            for position in range(1, order):
                mixed = torch.bitwise_xor(mixed, shifted[position])
            heads = slice((order - 2) * self.per_order, (order - 1) * self.per_order)
            ids = torch.remainder(mixed[:, None], self.vocab_sizes[None, heads])
            blocks.append(ids + self.offsets[None, heads])
        return torch.cat(blocks, dim=-1)[-new:]

    def last_rows(self, history: list[int]) -> list[int]:
        """`rows` for the last token of `history` alone, in plain Python: a decode or speculative
        step hashes a few tokens, where a dozen tiny tensor ops would cost far more than the arithmetic. The
        multipliers are below 2^63 / vocab, so the products fit int64 exactly as in `rows`."""
        last = len(history) - 1
        shifted = []
        for shift in range(self.ngram_size):
            crosses_document = self.eos in history[last - shift:last]
            shifted.append((self.eos if crosses_document else history[last - shift]) * self.multipliers[shift])
        ids = []
        for order in range(2, self.ngram_size + 1):
            mixed = 0
            for value in shifted[:order]:
                mixed ^= value
            for head in range((order - 2) * self.per_order, (order - 1) * self.per_order):
                ids.append(mixed % self.head_sizes[head] + self.head_offsets[head])
        return ids


FEW_TOKENS = 16  # up to here a step's rows are gathered on the host; a prompt's distinct rows on the device


class PLELayer(nn.Module):
    def __init__(
        self, cfg: TextConfig, source: WeightSource, prefix: str, ple_index: int,
        dtype: torch.dtype, device: torch.device | str,
    ):
        super().__init__()
        self.source, self.ple_index, self.hasher = source, ple_index, NGramHasher(cfg, ple_index)
        self.hc, self.hidden, self.dilation = cfg.hc_count, cfg.hidden_size, cfg.ngram_size
        self.dtype, self.device = dtype, device
        self.staging = PinnedStaging()  # a token's rows cross from pinned buffers it reuses
        load = lambda name: load_dense(source, prefix + name, dtype, device)  # noqa: E731
        self.key_proj = DenseLinear(source, prefix + "key_proj.weight", dtype, device)  # [hc*H, E]
        self.value_proj = DenseLinear(source, prefix + "value_proj.weight", dtype, device)  # [H, E]
        self.register_buffer("conv_weight", load("conv1d.weight"), persistent=False)  # [hc*H, 1, K]
        eps = cfg.rms_norm_eps
        self.norm_key = RMSNorm(load("norm_key.weight"), eps, group_size=cfg.hidden_size)
        self.norm_query = RMSNorm(load("norm_query.weight"), eps, group_size=cfg.hidden_size)
        self.norm_conv = RMSNorm(load("norm_conv.weight"), eps, group_size=cfg.hidden_size)

    def embed(self, tokens: torch.Tensor, state: PLEState) -> torch.Tensor:
        """tokens int64 [T] (on the host, or read back) -> concatenated n-gram rows [T, ple_embed_dim];
        advances the n-gram context."""
        tokens = tokens.cpu()
        count = tokens.shape[0]
        if count <= FEW_TOKENS:  # a decode or speculative step's: hashed in plain Python, gathered on the host
            history = state.context.tolist() + tokens.tolist()
            if state.tracked:
                state.history = torch.tensor(history, dtype=torch.int64)
            state.context = torch.tensor(history[count:], dtype=torch.int64)
            first = len(history) - count
            ids = [row for end in range(first + 1, len(history) + 1) for row in self.hasher.last_rows(history[:end])]
            rows = self.source.ple_rows(self.ple_index, torch.tensor(ids, dtype=torch.int64)).reshape(count, -1)
            return self.staging.to_device(rows.to(self.dtype), self.device)  # cast first: half the bytes to copy
        history = torch.cat([state.context, tokens])
        if state.tracked:
            state.history = history
        rows = self.hasher.rows(history, count)  # [T, heads]
        state.context = history[count:].clone()
        unique, inverse = torch.unique(rows.flatten(), return_inverse=True)
        fetched = self.source.ple_rows(self.ple_index, unique).to(device=self.device, dtype=self.dtype)
        return fetched[inverse.to(self.device)].reshape(rows.shape[0], -1)

    def forward(self, streams: torch.Tensor, tokens: torch.Tensor, state: PLEState) -> torch.Tensor:
        """streams [T, hc*H], tokens [T] -> the addend for the streams [T, hc*H]."""
        return self.addend(streams, self.embed(tokens, state), state)

    def addend(self, streams: torch.Tensor, embedded: torch.Tensor, state: PLEState) -> torch.Tensor:
        """The device half (decode replays it from a CUDA graph): gate the rows by the streams."""
        key = self.norm_key(self.key_proj(embedded)).unflatten(-1, (self.hc, self.hidden))
        value = self.value_proj(embedded)  # [T, H]
        query = self.norm_query(streams).unflatten(-1, (self.hc, self.hidden))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden)  # [T, hc, 1]
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()  # signed square root
        gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)  # [T, hc*H]
        return gated + self.short_conv(self.norm_conv(gated), state)

    def short_conv(self, x: torch.Tensor, state: PLEState) -> torch.Tensor:
        """Dilated depthwise causal conv + SiLU over x [T, C], continuing from state.conv [C, S]."""
        full = torch.cat([state.conv, x.transpose(0, 1)], dim=-1)  # [C, S + T]
        if state.tracked:
            state.window = full
        state.conv.copy_(full[:, full.shape[1] - state.conv.shape[1]:])  # in place, for CUDA graphs
        out = F.conv1d(full[None], self.conv_weight, dilation=self.dilation, groups=full.shape[0])[0]
        return F.silu(out).transpose(0, 1)
