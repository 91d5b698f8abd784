"""Engine pieces against their references, on awkward shapes: n-gram hashing, indexer, state."""

from __future__ import annotations

import torch
from reference_model import EOS, prompts, rel_err

from flashpack.runtime.kernels.reference import prompt_keep_mask
from flashpack.runtime.state import AttentionCache


def test_ngram_rows_match_transformers_across_eos_and_steps(bench, engine):
    cfg = bench.weights.config
    layer = cfg.ple_layer_ids[0] - 1
    theirs = bench.reference.model.layers[layer].ple.ple_embedding
    mine = engine.layers[layer].ple
    assert cfg.ple_multipliers(0) == theirs.layer_multipliers.tolist()
    tokens = [EOS, EOS, 9, EOS, 17, 18, EOS, 20, 21, 22, 23] + prompts()["long_72_eos"]
    with torch.no_grad():
        expected = theirs(torch.tensor([tokens]), None)[0]
    state = engine.new_state().ple[layer]
    cuts = [0, 1, 2, 3, 7, 8, 24, 41, len(tokens)]  # one token, a few (up to FEW_TOKENS, hashed in Python), a prompt's
    actual = torch.cat([mine.embed(torch.tensor(tokens[a:b]), state) for a, b in zip(cuts, cuts[1:])])
    assert torch.equal(actual, expected)
    assert state.context.tolist() == tokens[-(cfg.ngram_size - 1):]


def test_one_token_hash_equals_the_tensor_hash_at_full_size():
    """Decode hashes one token in plain Python ints; with the full preset's multipliers (up to
    2^63 / vocab) and ids near the vocabulary's top it must equal the int64 tensor form."""
    from flashpack.convert.synth.presets import SynthOptions, resolve_plan
    from flashpack.runtime.model.ple import NGramHasher

    cfg = resolve_plan(SynthOptions("full")).cfg
    hasher = NGramHasher(cfg, 0)
    gen = torch.Generator().manual_seed(4)
    histories = torch.randint(cfg.vocab_size - 64, cfg.vocab_size, (200, cfg.ngram_size), generator=gen)
    histories[torch.rand(histories.shape, generator=gen) < 0.2] = cfg.eos_token_id
    for history in histories:
        assert hasher.last_rows(history.tolist()) == hasher.rows(history, 1)[0].tolist()


def test_indexer_selection_equals_transformers_mask(bench, engine):
    """The engine's token selection per query equals the mask transformers' QSA indexer builds."""
    cfg = bench.weights.config
    layer = cfg.layer_types.index("indexed_attention")
    theirs = bench.reference.model.layers[layer].self_attn.indexer
    mine = engine.layers[layer].mixer
    length = 61
    x = torch.randn(length, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(length).view(1, 1, -1).expand(3, 1, -1)
    cos, sin = bench.reference.model.rotary_emb(x[None], positions)
    causal = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        expected = theirs(x[None], (cos, sin), causal, None)[0, 0]

    cache = AttentionCache(cfg.num_key_value_heads, cfg.head_dim, cfg.indexer_head_dim,
                           cfg.indexer_compress_ratio, torch.float32, "cpu", capacity=8)
    rope_cos, rope_sin = mine.rotary.cos_sin(torch.arange(length), torch.float32)
    queries, keys = mine.indexer.project(mine.in_proj.part(x, 3), rope_cos, rope_sin)
    cache.append(torch.zeros(cfg.num_key_value_heads, length, cfg.head_dim),
                 torch.zeros(cfg.num_key_value_heads, length, cfg.head_dim), keys)
    mine.indexer.pool_new_blocks(cache, mine.rotary)
    actual = prompt_keep_mask(mine.indexer.select_blocks(queries, 0, cache), 0, cfg.indexer_compress_ratio, length)
    assert torch.equal(actual, expected)
    for start in (13, 40):  # a later chunk of the same prompt picks the same keys
        chunk = mine.indexer.select_blocks(queries[start:], start, cache)
        assert torch.equal(prompt_keep_mask(chunk, start, cfg.indexer_compress_ratio, length), expected[start:])
    assert actual.sum(-1).max() <= cfg.indexer_budget + cfg.indexer_compress_ratio - 1
    for position in (15, 16, 19, 20, 40, 60):  # below, at and above the budget
        picked = mine.indexer.select_blocks(queries[position:position + 1], position, cache)  # one decode query
        row = prompt_keep_mask(picked, position, cfg.indexer_compress_ratio, length)[0].nonzero().flatten()
        assert torch.equal(row, expected[position].nonzero().flatten())
        # the decode graphs' form: a mask over the whole buffer (the blocks past the position masked)
        keep = mine.indexer.step_keep(queries[position:position + 1], torch.tensor([position]), cache)
        assert torch.equal(keep.nonzero().flatten(), row)


def test_step_keep_skips_the_scoring_only_where_every_block_fits_the_budget(engine):
    """A buffer of at most budget / ratio blocks: the decode graphs' mask is the causal prefix,
    taken without scoring the blocks, and scoring them (step_pick) must agree; a buffer one block
    larger scores them, and past the budget keeps less than the prefix."""
    cfg = engine.config
    indexer = engine.layers[cfg.layer_types.index("indexed_attention")].mixer.indexer
    gen = torch.Generator().manual_seed(5)
    for capacity in (cfg.indexer_budget, cfg.indexer_budget + cfg.indexer_compress_ratio):
        cache = AttentionCache(cfg.num_key_value_heads, cfg.head_dim, cfg.indexer_head_dim,
                               cfg.indexer_compress_ratio, torch.float32, "cpu", capacity=capacity)
        cache.append(torch.zeros(cfg.num_key_value_heads, capacity, cfg.head_dim),
                     torch.zeros(cfg.num_key_value_heads, capacity, cfg.head_dim),
                     torch.randn(capacity, cfg.indexer_head_dim, generator=gen))
        indexer.pool_new_blocks(cache, engine.layers[cfg.layer_types.index("indexed_attention")].mixer.rotary)
        assert cache.capacity == capacity
        query = torch.randn(1, cfg.indexer_n_heads, cfg.indexer_head_dim, generator=gen)
        for position in range(capacity):
            at = torch.tensor([position])
            keep = indexer.step_keep(query, at, cache)
            assert torch.equal(keep, indexer.step_pick(query, at, cache))
            ratio = cfg.indexer_compress_ratio
            over_budget = (position + 1) // ratio > cfg.indexer_budget // ratio
            if over_budget:  # one block more than the budget has been completed: one is left out
                assert int(keep.sum()) == position + 1 - ratio
            else:
                assert torch.equal(keep, torch.arange(capacity) <= position)
        assert capacity == cfg.indexer_budget or over_budget  # the larger buffer reached past the budget


def test_pooled_block_keys_are_incremental_and_exact(engine):
    """Blocks pooled as they complete, token by token, equal blocks pooled from a whole prompt."""
    tokens = prompts()["long_44"]
    whole, stepwise = engine.new_state(), engine.new_state()
    engine(torch.tensor(tokens), whole)
    for token in tokens:
        engine(torch.tensor([token]), stepwise)
    for layer, cache in whole.attention.items():
        if layer < engine.config.num_hidden_layers:
            blocks = len(tokens) // engine.config.indexer_compress_ratio
            assert cache.blocks == stepwise.attention[layer].blocks == blocks
            assert rel_err(stepwise.attention[layer].block_keys, cache.block_keys) <= 1e-5


def test_decode_never_reads_unfilled_cache(engine):
    """Poison every attention buffer past its length with NaN: decoding must not see it."""
    tokens = prompts()["long_44"]
    clean, poisoned = engine.new_state(), engine.new_state()
    engine(torch.tensor(tokens), clean)
    engine(torch.tensor(tokens), poisoned)
    for cache in poisoned.attention.values():
        cache._keys[:, cache.length:] = float("nan")
        cache._values[:, cache.length:] = float("nan")
        cache._index_keys[cache.length:] = float("nan")
        cache._block_keys[cache.blocks:] = float("nan")
    for token in (3, 4, EOS, 6):
        expected = engine(torch.tensor([token]), clean).logits
        actual = engine(torch.tensor([token]), poisoned).logits
        assert torch.isfinite(actual).all() and torch.equal(actual, expected)


def test_attention_cache_grows_by_doubling_and_keeps_contents():
    cache = AttentionCache(2, 4, 3, ratio=4, dtype=torch.float32, device="cpu", capacity=4)
    keys = torch.randn(2, 37, 4)
    for start in range(0, 37, 5):
        chunk = slice(start, min(start + 5, 37))
        cache.append(keys[:, chunk], -keys[:, chunk], keys[0, chunk, :3])
    assert cache.length == 37 and cache.capacity == 64
    assert torch.equal(cache.keys, keys) and torch.equal(cache.values, -keys)
    copy = cache.copy()
    copy.append(keys[:, :1], keys[:, :1], keys[0, :1, :3])
    assert cache.length == 37 and torch.equal(copy.keys[:, :37], keys)
