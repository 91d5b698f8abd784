"""The bench's prompt: N token ids drawn (seeded) from the pack's vocabulary, special tokens left out.

Ids, not text, so the prompt is exactly N tokens whatever the tokenizer merges, both engines get the
same ids, and no tokenizer work is timed. Left out: every id the tokenizer calls special (its added
special tokens, EOS included), the model's EOS (which would restart PLE n-grams), and ids past the
tokenizer's vocabulary (padding rows of the embedding).
"""

from __future__ import annotations

import torch


def ordinary_ids(tokenizer, vocab_size: int, eos_token_id: int | None = None) -> torch.Tensor:
    """int64 ids below `vocab_size` that are plain text tokens of `tokenizer`."""
    limit = min(vocab_size, len(tokenizer))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    if eos_token_id is not None:
        special.add(int(eos_token_id))
    keep = torch.ones(limit, dtype=torch.bool)
    for token_id in special:
        if 0 <= token_id < limit:
            keep[token_id] = False
    return torch.nonzero(keep).flatten()


def prompt_ids(tokenizer, vocab_size: int, length: int, seed: int, eos_token_id: int | None = None) -> list[int]:
    """`length` ids, the same for the same (tokenizer, seed)."""
    pool = ordinary_ids(tokenizer, vocab_size, eos_token_id)
    if pool.numel() == 0:
        raise ValueError("the tokenizer has no ordinary tokens to build a prompt from")
    picks = torch.randint(0, pool.numel(), (length,), generator=torch.Generator().manual_seed(seed))
    return pool[picks].tolist()
