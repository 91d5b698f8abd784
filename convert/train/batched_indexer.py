"""transformers' QSA indexer, batched for training on whole causal sequences.

transformers' `Qwen4ExpTextQSAIndexer.forward` loops in Python over every batch row and query (a
1024-token batch of 32 is 32k iterations of a dozen kernels, per QSA layer), since it serves any
mask and cache. Training feeds whole sequences from position 0 with the plain causal mask and no
cache, where every query's visible tokens are 0..i: its complete blocks are the sequence's first
(i + 1) // ratio blocks, the same pooled keys for every query. `BatchedQSAIndexer` computes that
case for all queries at once: the same parameters, the same block scores (sum over heads of
relu(q.k) / sqrt(d)) and the same selection (the top budget / ratio complete blocks plus the
incomplete tail), as tests/train/test_batched_indexer.py checks against transformers' loop. It
refuses a cache (decode is transformers' or the engine's business).

It also keeps what the indexer loss needs: the block scores of the last forward (computed from a
detached input, so that loss trains the indexer alone) and which blocks were selected.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf


class BatchedQSAIndexer(hf.Qwen4ExpTextQSAIndexer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.last_scores: torch.Tensor | None = None  # [B, T, blocks] float32, grad to the indexer only
        self.last_selected: torch.Tensor | None = None  # [B, T, blocks] bool

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values) -> torch.Tensor:
        if past_key_values is not None:
            raise ValueError("BatchedQSAIndexer serves whole training sequences, not cached decoding")
        batch, length, _ = hidden_states.shape
        ratio = self.compress_ratio
        blocks = length // ratio
        scores = self._block_scores(hidden_states.detach(), position_embeddings, blocks)  # [B, T, blocks]

        positions = torch.arange(length, device=hidden_states.device)
        complete = (positions + 1) // ratio  # complete blocks query i sees
        valid = torch.arange(blocks, device=hidden_states.device)[None, :] < complete[:, None]  # [T, blocks]
        ranked = scores.detach().masked_fill(~valid, float("-inf"))
        selected = torch.zeros_like(valid).expand(batch, -1, -1).clone()
        if blocks:
            top = ranked.topk(min(self.block_topk, blocks), dim=-1).indices
            selected.scatter_(-1, top, True)
            selected &= valid
        self.last_scores, self.last_selected = scores, selected

        # Token j is kept for query i when it is in a selected complete block, or in i's tail.
        block_of_token = (positions // ratio).clamp(max=max(blocks - 1, 0))
        in_selected_block = selected[:, :, block_of_token] & (positions < blocks * ratio)  # [B, T, T]
        in_tail = (positions[None, :] >= (complete * ratio)[:, None]) & (positions[None, :] <= positions[:, None])
        return (in_selected_block | in_tail).unsqueeze(1)

    def _block_scores(self, hidden_states, position_embeddings, blocks: int) -> torch.Tensor:
        """Scores [B, T, blocks] of every query against every complete block of the sequence."""
        batch, length, _ = hidden_states.shape
        cos, sin = position_embeddings
        cos, sin = cos[:, -length:], sin[:, -length:]
        q, raw_keys = self.index_qk_proj(hidden_states).split(
            [self.index_n_heads * self.index_head_dim, self.index_kv_heads * self.index_head_dim], dim=-1
        )
        q = hf.apply_rotary_pos_emb(
            self.q_layernorm(q.reshape(batch, length, -1, self.index_head_dim)), cos=cos, sin=sin, unsqueeze_dim=2
        )
        # Pooled in float32 and cast back, as transformers pools; roped at each block's first token.
        pooled = raw_keys[:, : blocks * self.compress_ratio].reshape(batch, blocks, self.compress_ratio, -1)
        pooled = self.k_layernorm(pooled.float().mean(dim=2).to(raw_keys.dtype))
        starts = slice(0, blocks * self.compress_ratio, self.compress_ratio)
        block_keys = hf.apply_rotary_pos_emb(
            pooled.unsqueeze(2), cos=cos[:, starts], sin=sin[:, starts], unsqueeze_dim=2
        ).squeeze(2)
        dots = torch.einsum("bthd,bnd->bthn", q.float(), block_keys.float())
        return torch.relu(dots).sum(dim=2) / math.sqrt(self.index_head_dim)


def install_batched_indexers(module: nn.Module) -> int:
    """Replace every transformers QSA indexer under `module` by a BatchedQSAIndexer holding the
    same weights; returns how many were replaced."""
    replaced = 0
    for parent in list(module.modules()):
        indexer = getattr(parent, "indexer", None)
        if type(indexer) is hf.Qwen4ExpTextQSAIndexer:
            batched = BatchedQSAIndexer(parent.config, indexer.layer_idx)
            batched.load_state_dict(indexer.state_dict())
            parent.indexer = batched.to(next(indexer.parameters()).device, next(indexer.parameters()).dtype)
            replaced += 1
    return replaced
