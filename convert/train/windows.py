"""Token streams cut into training windows, and the seeded order they are read in.

Each slice of the corpus becomes one stream: every file's tokens followed by <|endoftext|> (the
config's eos, where PLE's n-grams restart), files in corpus order. Window i is the T + 2 tokens
from i * T, so consecutive windows share two tokens and every token is a main-loss target exactly
once. Training reads the windows in a fresh permutation each epoch, drawn from a generator seeded
with (seed, epoch): the order depends on nothing but the seed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from tokenizers import Tokenizer

from flashpack.errors import FlashpackError


def token_stream(tokenizer: Tokenizer, texts: Sequence[str], eos: int) -> torch.Tensor:
    """int32 [N]: each text's ids, then eos."""
    pieces = []
    for encoding in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        pieces.append(torch.tensor(encoding.ids + [eos], dtype=torch.int32))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)


class Windows:
    def __init__(self, stream: torch.Tensor, length: int):
        self.stream, self.length = stream, length
        self.count = max(0, (stream.numel() - 2) // length)
        if self.count == 0:
            raise FlashpackError(f"{stream.numel()} tokens make no window of {length} + 2")

    def batch(self, indices: torch.Tensor) -> torch.Tensor:
        """int64 [len(indices), T + 2]."""
        starts = indices.long()[:, None] * self.length + torch.arange(self.length + 2)[None, :]
        return self.stream[starts].long()

    def in_order(self, batch_size: int, limit: int | None = None) -> Iterator[torch.Tensor]:
        """The first `limit` windows (all by default), in order, batch by batch."""
        count = self.count if limit is None else min(limit, self.count)
        for start in range(0, count, batch_size):
            yield self.batch(torch.arange(start, min(start + batch_size, count)))

    def shuffled(self, batch_size: int, seed: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(epoch, batch) forever; full batches only (an epoch's remainder is dropped)."""
        if self.count < batch_size:
            raise FlashpackError(f"{self.count} training windows do not fill a batch of {batch_size}")
        epoch = 0
        while True:
            order = torch.randperm(self.count, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
            for start in range(0, self.count - batch_size + 1, batch_size):
                yield epoch, self.batch(order[start : start + batch_size])
            epoch += 1
