"""The engine's step: the next tokens of one or more sequences in, their logits out.

    step([StepInput(tokens, state, last_only), ...]) -> [StepOutput, ...]
    step.forward(tokens, state, last_only)           one sequence (what generation calls)

A sequence's tokens may be a whole prompt (prefill), one token (decode) or k + 1 tokens
(speculative verification: logits for each); the state carries everything needed to continue.
Today a step takes one sequence; the list form is the interface batching fills in.

A one-token step replays the decoder layers from CUDA graphs when the engine has them
(decode_graphs.py), and so does a tracked step of a few tokens, speculative decoding's checked
step (checked_graphs.py; through a tiered store its routed experts run eagerly between the
graphs). With `prompt_graphs_max_tokens`, a short prompt (a follow-up's new tokens after a restored
state) with every expert resident runs as checked steps too, in chunks of the few lengths the
graphs are warmed for (checked_graphs.chunk_lengths), each kept whole: an eager step of ~100 tokens
is paced by the host's launches, several hundred a layer, where a chunk's layer is one replay.
Everything else runs the model's layers eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashpack.runtime.engine.checked_graphs import CheckedGraphs, chunk_lengths
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
                 checked: CheckedGraphs | None = None, prompt_graphs_max_tokens: int = 0):
        self.model, self.graphs, self.checked = model, graphs, checked
        self.config = model.config
        # EngineConfig.prompt_graphs_max_tokens: the longest prompt run in checked steps (0: none)
        self.prompt_graphs_max_tokens = prompt_graphs_max_tokens

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
        if depth is None and self._prompt_in_chunks(count, state, marks):
            return self._chunked(tokens, state, last_only, marks)
        if depth is not None or marks or not (one_token or checked):
            return self.model.forward(tokens, state, last_only=last_only, depth=depth, marks=marks)
        state.arrive_all()  # the graphs read every layer's state: a stored state still arriving lands first
        if one_token:
            host_tokens = tokens.cpu()  # the PLE layers hash them on the host: no read-back mid-step
            streams = self.model.embed(tokens.to(self.model.device)).repeat(1, self.config.hc_count)  # [T, hc*H]
            streams, logits = self.graphs.run(streams, host_tokens, state, head=self.model.logits)
        else:
            # the PLE layers hash the tokens on the host: no read-back mid-step
            streams = self._checked(tokens.cpu(), tokens.to(self.model.device), state)
            logits = self.model.logits(streams[-1:] if last_only else streams)
        state.position += count
        return StepOutput(logits=logits, streams=streams)

    def _checked(self, host_tokens: torch.Tensor, tokens: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """A tracked step's streams [T, hc*H] from the checked graphs (the position not advanced);
        the T tokens on the host and on the device."""
        streams = self.model.embed(tokens).repeat(1, self.config.hc_count)
        if self.graphs is not None:
            self.graphs.settle()  # the store sees the decode steps before it, in order
        return self.checked.run(streams, host_tokens, state)

    def _prompt_in_chunks(self, count: int, state: SequenceState, marks: Sequence[int]) -> bool:
        """Whether these tokens run as checked steps (`prompt_graphs_max_tokens`): an untracked
        step of 2 or more tokens, every expert resident (through a store each chunk would fetch
        its experts again), not on a stored state still arriving (whose layers the eager step
        restores beside its work), and no mark closer than 2 tokens to the one before."""
        if not (2 <= count <= self.prompt_graphs_max_tokens and self.checked is not None
                and not self.checked.through_store and not state.tracked and state.arriving is None):
            return False
        bounds = [0, *marks, count]
        return all(end - start >= 2 for start, end in zip(bounds, bounds[1:]))

    def _chunked(self, tokens: torch.Tensor, state: SequenceState, last_only: bool,
                 marks: Sequence[int]) -> StepOutput:
        """The step as checked steps of chunk_lengths, each kept whole, cut at the marks (whose states
        are copied as each is reached, as Qwen4ExpModel.forward returns them)."""
        count = tokens.shape[0]
        # one copy each way for the whole prompt (a copy from pageable memory waits for the device)
        host_tokens, tokens = tokens.cpu(), tokens.to(self.model.device)
        streams, marked, start = None, [], 0
        for end in [*marks, count]:
            for length in chunk_lengths(end - start):
                state.track()
                chunk = slice(start, start + length)
                out = self._checked(host_tokens[chunk], tokens[chunk], state)
                if streams is None:
                    streams = out.new_empty((count, out.shape[1]))
                streams[chunk] = out  # copied out: a replay writes its outputs into the same tensors every time
                state.position += length
                state.rewind(length)  # keeps every token: copies nothing
                start += length
            if end < count:
                marked.append(SequenceState(
                    position=state.position,
                    deltanet={layer: part.copy() for layer, part in state.deltanet.items()},
                    attention=state.checkpoint_attention(state.position, self.config.num_hidden_layers),
                    ple={layer: part.copy() for layer, part in state.ple.items()}))
        logits = self.model.logits(streams[-1:] if last_only else streams)
        return StepOutput(logits=logits, streams=streams, marked=marked or None)

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
