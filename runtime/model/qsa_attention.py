"""QSA attention: gated GQA attention whose keys a block indexer picks once the context is long.

The indexer keeps one raw key per token (its own single head); every `ratio` consecutive keys are
mean-pooled into a block key, normalised and roped at the block's first position (done once, when
a block completes, and cached). A query at position p sees nb = (p + 1) // ratio complete blocks:
if nb <= budget / ratio it attends to all of 0..p; otherwise its indexer heads score every complete
block (sum over heads of relu(q.k) / sqrt(d)), and it attends to the tokens of the top budget/ratio
blocks plus the incomplete tail. Decode therefore reads at most budget + ratio - 1 keys.

Attention itself: q_proj yields per head a query and a same-sized output gate (sigmoid); q/k norms
per head (zero-centred); partial rotary; KV heads shared by groups of query heads.

`attend_cache` (prompts, and eager decode) appends at the cache's host-side length; each query takes
`select_blocks` (its chosen blocks and its own incomplete one) and attends to exactly those keys with
the sparse prompt-attention kernel (runtime/kernels/prompt_attention.py; off CUDA its reference, the
masked SDPA call), a chunk of queries at a time.

Decode graphs take `attend_step` (replayed from a CUDA graph, so every shape is fixed and the
position is a device tensor): it writes in place at the position, re-pools the block holding it
(complete once its last token is in; until then the stale pool is masked), and attends over the
whole buffer with a mask of the same picked keys (on CUDA a split-K kernel that reads only the kept
keys, runtime/kernels/decode_attention.py). The two agree to rounding, and exactly in which keys
they use, except that where the indexer's k-th and (k+1)-th block scores tie, top-k over the padded
buffer may keep the other tied block.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flashpack.layout.model_config import TextConfig
from flashpack.runtime.kernels import decode_attention, prompt_attention
from flashpack.runtime.model.compiled import piece
from flashpack.runtime.model.linear import DenseLinear, StackedLinear
from flashpack.runtime.model.norms import RMSNorm
from flashpack.runtime.model.rope import Rotary, apply_rotary
from flashpack.runtime.state import AttentionCache
from flashpack.runtime.weights import WeightSource, load_dense

QUERY_CHUNK = 1024  # prompt queries attended per step


class BlockIndexer(nn.Module):
    def __init__(self, cfg: TextConfig, source: WeightSource, prefix: str, dtype: torch.dtype, device):
        super().__init__()
        self.heads, self.dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.ratio, self.block_topk = cfg.indexer_compress_ratio, cfg.indexer_budget // cfg.indexer_compress_ratio
        load = lambda name: load_dense(source, prefix + name, dtype, device)  # noqa: E731
        self.q_norm = RMSNorm(load("q_layernorm.weight"), cfg.rms_norm_eps)
        self.k_norm = RMSNorm(load("k_layernorm.weight"), cfg.rms_norm_eps)

    def project(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qk [T, (heads + 1) * d] (x through index_qk_proj, stacked with the attention's own
        projections) -> queries [T, heads, d] (normed, roped), raw keys [T, d]."""
        q, keys = qk.split([self.heads * self.dim, self.dim], dim=-1)
        q = apply_rotary(self.q_norm(q.unflatten(-1, (self.heads, self.dim))), cos, sin)
        return q, keys

    def pool_new_blocks(self, cache: AttentionCache, rotary: Rotary) -> None:
        """Pool, norm and rope the blocks completed since the last call; append them to the cache."""
        first, complete = cache.blocks, cache.length // self.ratio
        if complete == first:
            return
        tokens = cache.index_keys[first * self.ratio: complete * self.ratio]
        pooled = tokens.unflatten(0, (-1, self.ratio)).float().mean(dim=1).to(tokens.dtype)
        starts = torch.arange(first, complete, device=tokens.device) * self.ratio
        cos, sin = rotary.cos_sin(starts, tokens.dtype)
        cache.append_blocks(apply_rotary(self.k_norm(pooled)[:, None], cos, sin)[:, 0])

    def pool_block_at(self, cache: AttentionCache, position: torch.Tensor, rotary: Rotary) -> None:
        """Decode graphs: pool, norm and rope the block holding `position` (int64 [1], device)
        into the block keys, in place; it is final once the block's last token is written."""
        _, _, index_keys, block_keys = cache.buffers()
        block = torch.div(position, self.ratio, rounding_mode="floor")
        start = block * self.ratio
        tokens = index_keys.index_select(0, start + torch.arange(self.ratio, device=position.device))
        pooled = tokens.float().mean(dim=0, keepdim=True).to(tokens.dtype)
        cos, sin = rotary.cos_sin(start, tokens.dtype)
        block_keys.index_copy_(0, block, apply_rotary(self.k_norm(pooled)[:, None], cos, sin)[:, 0])

    def step_keep(self, query: torch.Tensor, position: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        """Decode graphs: query [1, heads, d] at `position` (int64 [1], device) -> bool [capacity],
        the keys `select_indices` picks (all of 0..position while the blocks fit the budget)."""
        if cache.buffers()[3].shape[0] <= self.block_topk:
            # every block the buffer can hold fits the budget: the causal prefix, without scoring
            # blocks or a top-k whose choice could not matter (12.7 us a QSA layer on the H200)
            return torch.arange(cache.capacity, device=query.device) <= position
        return self.step_pick(query, position, cache)

    def step_pick(self, query: torch.Tensor, position: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        """`step_keep` by scoring the blocks, whatever the buffer's size."""
        _, _, _, block_keys = cache.buffers()
        capacity, device = cache.capacity, query.device
        tokens = torch.arange(capacity, device=device)
        complete = torch.div(position + 1, self.ratio, rounding_mode="floor")  # [1]
        seen = torch.arange(block_keys.shape[0], device=device) < complete
        scores = self.block_scores(query, block_keys)[0].masked_fill(~seen, float("-inf"))
        top = scores.topk(min(self.block_topk, block_keys.shape[0])).indices
        chosen = torch.zeros_like(seen).scatter(0, top, True) & seen
        chosen = torch.where(complete <= self.block_topk, seen, chosen)
        in_tail = tokens >= complete * self.ratio
        return (chosen.repeat_interleave(self.ratio) | in_tail) & (tokens <= position)

    def block_scores(self, queries: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """queries [T, heads, d], blocks [B, d] -> [T, B] = sum_heads relu(q.k) / sqrt(d), fp32."""
        scores = torch.einsum("thd,bd->tbh", queries.float(), blocks.float())
        return torch.relu(scores).sum(dim=-1) / math.sqrt(self.dim)

    def select_blocks(self, queries: torch.Tensor, start: int, cache: AttentionCache) -> torch.Tensor:
        """int32 [T, min(budget / ratio, complete blocks) + 1]: the key blocks each query (positions
        start..start+T-1) attends to: its chosen complete blocks (every one while they fit the
        budget, else the top-scored), ascending, then its own incomplete block (whose keys past the
        query a consumer masks: `prompt_keep_mask`); -1 pads."""
        length, device = start + queries.shape[0], queries.device
        positions = torch.arange(start, length, device=device)
        visible = (positions + 1) // self.ratio  # complete blocks per query
        most = length // self.ratio  # complete blocks the last query sees
        width = min(self.block_topk, most)
        every = torch.arange(width, device=device)[None, :].expand(queries.shape[0], -1)
        chosen = torch.where(every < visible[:, None], every, -1)  # under the budget: every block
        if most > self.block_topk:
            seen = torch.arange(most, device=device)[None, :] < visible[:, None]  # [T, most]
            scores = self.block_scores(queries, cache.block_keys[:most]).masked_fill(~seen, float("-inf"))
            top = self._top_blocks(scores, visible).sort(dim=-1).values
            chosen = torch.where((visible > self.block_topk)[:, None], top, chosen)
        return torch.cat([chosen, visible[:, None]], dim=-1).to(torch.int32)

    def _top_blocks(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Top blocks per query row of scores [T, most]; ties at the cut are broken as transformers does.

        relu makes exact ties (0.0) common. A batched top-k over the padded rows orders tied blocks
        differently from the reference's top-k over each query's own visible scores, so rows whose
        k-th and (k+1)-th scores tie are redone that way; other rows select the same set either way.
        """
        k = self.block_topk
        top = scores.topk(min(k + 1, scores.shape[1]), dim=-1)
        indices = top.indices[:, :k].clone()
        if top.values.shape[1] > k:
            tied = (top.values[:, k - 1] == top.values[:, k]) & (visible > k)
            for row in torch.nonzero(tied).flatten().tolist():
                indices[row] = scores[row, : int(visible[row])].topk(k, dim=0).indices
        return indices


class QSAAttention(nn.Module):
    def __init__(self, cfg: TextConfig, source: WeightSource, prefix: str, rotary: Rotary, dtype, device):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rotary = rotary
        load = lambda name: load_dense(source, prefix + name, dtype, device)  # noqa: E731
        project = lambda name: DenseLinear(source, prefix + name, dtype, device)  # noqa: E731
        # q [heads * 2 * hd, H], k and v [kv_heads * hd, H], the indexer's [(heads_i + 1) * d, H]
        names = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "indexer.index_qk_proj.weight")
        self.in_proj = StackedLinear(source, [prefix + name for name in names], dtype, device)
        self.o_proj = project("o_proj.weight")  # [H, heads * hd]
        self.q_norm = RMSNorm(load("q_norm.weight"), cfg.rms_norm_eps)
        self.k_norm = RMSNorm(load("k_norm.weight"), cfg.rms_norm_eps)
        self.indexer = BlockIndexer(cfg, source, prefix + "indexer.", dtype, device)
        self.compile_pieces = False  # the model sets it (compiled.py): `projected` and `gated_output`

    def forward(self, x: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        """x [T, H] at positions cache.length.. -> [T, H]; appends the T tokens to `cache`."""
        positions = torch.arange(cache.length, cache.length + x.shape[0], device=x.device)
        q, gate, k, v, index_q, index_k = piece(projected, self.compile_pieces)(self, x, positions)
        attended = self.attend_cache(q, k, v, index_q, index_k, cache)
        return piece(gated_output, self.compile_pieces)(self, attended, gate)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What depends on x and the positions alone (decode replays it from a CUDA graph):
        x [T, H] -> q [T, heads, hd] (normed, roped), gate [T, heads * hd], k (normed, roped) and
        v [T, kv_heads, hd], the indexer's queries [T, heads_i, d] and raw keys [T, d]."""
        length = x.shape[0]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q, k, v, index_qk = self.in_proj(x)
        q, gate = q.view(length, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k.view(length, self.kv_heads, self.head_dim)), cos, sin)
        v = v.view(length, self.kv_heads, self.head_dim)
        index_q, index_k = self.indexer.project(index_qk, cos, sin)
        return q, gate.reshape(length, self.heads * self.head_dim), k, v, index_q, index_k

    def attend_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
        cache: AttentionCache,
    ) -> torch.Tensor:
        """Append the T new keys to `cache`, attend each query to the keys its indexer picks -> [T, heads * hd]
        (a prompt, or one eager decode step)."""
        length, start = q.shape[0], cache.length
        cache.append(k.transpose(0, 1), v.transpose(0, 1), index_k)
        self.indexer.pool_new_blocks(cache, self.rotary)
        pieces = []  # query chunks bound the indexer's [chunk, blocks] scores
        for a in range(0, length, QUERY_CHUNK):
            b = min(a + QUERY_CHUNK, length)
            blocks = self.indexer.select_blocks(index_q[a:b], start + a, cache)
            pieces.append(prompt_attention(q[a:b], cache.keys, cache.values, blocks, start + a, self.indexer.ratio,
                                           self.head_dim ** -0.5))
        return torch.cat(pieces).reshape(length, self.heads * self.head_dim)

    def attend_step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
        cache: AttentionCache, position: torch.Tensor,
    ) -> torch.Tensor:
        """One token at `position` (int64 [1] on the device), fixed shapes for a CUDA graph: write it
        into the cache in place (the caller reserves room and advances the length) -> [1, heads * hd].
        The query heads of each KV head attend as a group to that head alone."""
        keys, values, index_keys, _ = cache.buffers()
        keys.index_copy_(1, position, k.transpose(0, 1))
        values.index_copy_(1, position, v.transpose(0, 1))
        index_keys.index_copy_(0, position, index_k)
        self.indexer.pool_block_at(cache, position, self.rotary)
        keep = self.indexer.step_keep(index_q, position, cache)
        grouped = q[0].unflatten(0, (self.kv_heads, -1))  # [kv_heads, group, hd]
        out = decode_attention(grouped, keys, values, keep, self.head_dim ** -0.5)  # split over the keys
        return out.reshape(1, self.heads * self.head_dim)

    def output(self, attended: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """attended [T, heads * hd] gated by sigmoid(gate) -> o_proj -> [T, H]."""
        return self.o_proj(attended * torch.sigmoid(gate))


def projected(attention: QSAAttention, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`QSAAttention.project` as a module-level function, compiled with `compile_pieces`."""
    return attention.project(x, positions)


def gated_output(attention: QSAAttention, attended: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`QSAAttention.output` as a module-level function, compiled with `compile_pieces`."""
    return attention.output(attended, gate)
