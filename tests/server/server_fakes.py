"""A stand-in model with the engine's step interface: deterministic pseudo-random logits, optional delay.

Used where the real tiny model would make a test slow or timing-dependent (queueing, cancellation):
it pairs with the real tiny pack's tokenizer, so prompts, templates and grammars are the real ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from flashpack.runtime.engine.generate import Generator


@dataclass
class _State:
    position: int = 0
    last: int = 0
    steps: int = 0

    def restore(self, other: "_State") -> None:  # the Generator resets one state per request
        self.position, self.last, self.steps = other.position, other.last, other.steps

    def reserve(self, tokens: int) -> None:
        pass


@dataclass
class FakeModel:
    vocab_size: int
    max_position_embeddings: int = 4096
    seconds_per_step: float = 0.0
    steps: int = 0  # forward calls so far, across all requests
    broken: bool = False  # raise inside forward, as a failing engine would
    never: tuple[int, ...] = ()  # ids it never says (end-of-turn ids: replies then run to max_tokens)
    config: SimpleNamespace = field(init=False)

    def __post_init__(self) -> None:
        self.config = SimpleNamespace(vocab_size=self.vocab_size, max_position_embeddings=self.max_position_embeddings)

    def new_state(self) -> _State:
        return _State()

    def forward(self, tokens: torch.Tensor, state: _State, last_only: bool = False) -> SimpleNamespace:
        """tokens [T] -> logits [1, vocab]: a hash of (last token, position) seeds the draw."""
        self.steps += 1
        if self.broken:
            raise RuntimeError("the engine broke")
        if self.seconds_per_step:
            time.sleep(self.seconds_per_step)
        state.position += int(tokens.shape[0])
        state.last = int(tokens[-1])
        seed = (state.last * 1_000_003 + state.position * 7919) % (2**31)
        logits = torch.randn(1, self.vocab_size, generator=torch.Generator().manual_seed(seed))
        logits[0, list(self.never)] = -1e4
        return SimpleNamespace(logits=logits)


@dataclass
class ScriptedModel(FakeModel):
    """Says `script` (token ids), then `end` (an end-of-turn id), whatever the prompt."""

    script: list[int] = field(default_factory=list)
    end: int = 0

    def forward(self, tokens: torch.Tensor, state: _State, last_only: bool = False) -> SimpleNamespace:
        self.steps += 1
        state.position += int(tokens.shape[0])
        nxt = self.script[state.steps] if state.steps < len(self.script) else self.end
        state.steps += 1
        logits = torch.zeros(1, self.vocab_size)
        logits[0, nxt] = 50.0  # certain at any temperature
        return SimpleNamespace(logits=logits)


@dataclass
class FakeEngine:
    """What the server uses of runtime.engine.Engine."""

    model: FakeModel
    tokenizer: object  # PackTokenizer
    generator: Generator
    pack: object = None

    @property
    def model_config(self):
        return self.model.config


def fake_engine(tokenizer, seconds_per_step: float = 0.0, max_position_embeddings: int = 4096) -> FakeEngine:
    model = FakeModel(len(tokenizer.tokenizer), max_position_embeddings, seconds_per_step,
                      never=tuple(tokenizer.stop_token_ids))
    return FakeEngine(model, tokenizer, Generator(model, tokenizer))


def scripted_engine(tokenizer, text: str) -> FakeEngine:
    """An engine whose every reply is `text` (as the tokenizer encodes it), then end of turn."""
    model = ScriptedModel(len(tokenizer.tokenizer), script=tokenizer.encode(text), end=tokenizer.stop_token_ids[0])
    return FakeEngine(model, tokenizer, Generator(model, tokenizer))
