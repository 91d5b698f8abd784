"""The engine's step: the next tokens of one or more sequences in, their logits out.

    step([StepInput(tokens, state, last_only), ...]) -> [StepOutput, ...]
    step.forward(tokens, state, last_only)           one sequence (what generation calls)

A sequence's tokens may be a whole prompt (prefill), one token (decode) or k + 1 tokens
(speculative verification: logits for each); the state carries everything needed to continue.
Today a step takes one sequence; the list form is the interface batching fills in.

A one-token step replays the decoder layers from CUDA graphs when the engine has them
(decode_graphs.py), and so does a tracked step of a few tokens, speculative decoding's checked
step (checked_graphs.py; through a tiered store its routed experts run eagerly between the
graphs); everything else runs the model's layers eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashpack.runtime.engine.checked_graphs import CheckedGraphs
from flashpack.runtime.engine.decode_graphs import DecodeGraphs
from flashpack.runtime.model.model import Qwen4ExpModel, StepOutput
from flashpack.runtime.state import SequenceState


@dataclass
class StepInput:
    tokens: torch.Tensor  # int64 [T]: the sequence's next T tokens
    state: SequenceState  # advanced by T
    last_only: bool = False  # logits of the last token alone (prefill, plain decode)


class Step:
    def __init__(self, model: Qwen4ExpModel, graphs: DecodeGraphs | None = None,
                 checked: CheckedGraphs | None = None):
        self.model, self.graphs, self.checked = model, graphs, checked
        self.config = model.config

    def __call__(self, inputs: Sequence[StepInput]) -> list[StepOutput]:
        if len(inputs) != 1:
            raise ValueError(f"a step takes one sequence today, got {len(inputs)}")
        return [self.forward(item.tokens, item.state, item.last_only) for item in inputs]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, state: SequenceState, last_only: bool = False,
                depth: int | None = None, marks: Sequence[int] = ()) -> StepOutput:
        """tokens int64 [T] -> StepOutput; advances `state` by T. `depth`: the first `depth`
        decoder layers only (a warm-up's prompts; the state is then good for nothing else).
        `marks`: token counts within the T after which the state is wanted too (Qwen4ExpModel.forward)."""
        count = tokens.shape[0] if tokens.ndim == 1 else 0
        one_token = self.graphs is not None and count == 1
        checked = self.checked is not None and state.tracked and self.checked.takes(count)
        if depth is not None or marks or not (one_token or checked):
            return self.model.forward(tokens, state, last_only=last_only, depth=depth, marks=marks)
        state.arrive_all()  # the graphs read every layer's state: a stored state still arriving lands first
        host_tokens = tokens.cpu()  # the PLE layers hash them on the host: no read-back mid-step
        streams = self.model.embed(tokens.to(self.model.device)).repeat(1, self.config.hc_count)  # [T, hc*H]
        if one_token:
            streams, logits = self.graphs.run(streams, host_tokens, state, head=self.model.logits)
        else:
            if self.graphs is not None:
                self.graphs.settle()  # the store sees the decode steps before it, in order
            streams = self.checked.run(streams, host_tokens, state)
            logits = self.model.logits(streams[-1:] if last_only else streams)
        state.position += count
        return StepOutput(logits=logits, streams=streams)

    def warming(self, tokens: int, state: SequenceState) -> bool:
        """Whether a tracked step of `tokens` on `state` would compile or capture its graphs rather
        than replay them (CheckedGraphs.warming): a cost paid once, not the step's."""
        return self.checked is not None and self.checked.takes(tokens) and self.checked.warming(tokens, state)

    def new_state(self) -> SequenceState:
        return self.model.new_state()

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self.model.logits(streams)

    def settle(self) -> None:
        """Finish the bookkeeping decode steps defer (DecodeGraphs.settle): before reading the
        expert store's counters."""
        if self.graphs is not None:
            self.graphs.settle()
