"""The MTP head: drafts the token after next from the backbone's streams and the next token.

For a backbone position p with pre-final-mixer streams h_p [hc*H] and the token x_{p+1} after it
(vLLM's qwen4_exp MTP, "residual_linear_shared"):

    e = fc_embedding(rms(embed(x_{p+1})))                  [H]    rms: zero-centred, whole vector
    s = fc_hidden per stream of rms(h_p) (norm over all hc*H)  [hc, H]
    s = decoder layer (QSA + MoE, no PLE) with e added to every stream first (unit weight)
    logits(x_{p+2}) = lm_head(mtp final mixer(s))          s is also the next draft step's input

The MTP layer keeps its own KV/indexer cache in the SequenceState at layer num_hidden_layers + j;
its length is the MTP position (entry p sits at position p, like vLLM's target positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flashpack.runtime.experts import ExpertFetcher
from flashpack.runtime.model.routed_experts import RoutedExperts, as_routed_experts
from flashpack.runtime.model.decoder_layer import DecoderLayer
from flashpack.runtime.model.hyper_connection import GatedResidual
from flashpack.runtime.model.model import Qwen4ExpModel
from flashpack.runtime.model.linear import DenseLinear
from flashpack.runtime.model.norms import RMSNorm
from flashpack.runtime.state import SequenceState
from flashpack.runtime.weights import WeightSource, load_dense


@dataclass
class DraftOutput:
    logits: torch.Tensor | None  # [T, vocab]: draft distribution of the token after next
    streams: torch.Tensor  # [T, hc * H]: input for the next draft step


class MTPHead(nn.Module):
    def __init__(self, model: Qwen4ExpModel, source: WeightSource, experts: RoutedExperts | ExpertFetcher | None = None):
        """`experts`: the MTP layers' routed experts (layer num_hidden_layers + j); None: the model's."""
        super().__init__()
        cfg, dtype, device = model.config, model.dtype, model.device
        routed = model.experts if experts is None else as_routed_experts(experts, cfg, dtype, device)
        self.config, self.device = cfg, device
        self.embed_tokens, self.lm_head = model.embed_tokens, model.lm_head  # shared, not copied
        load = lambda name: load_dense(source, "mtp." + name, dtype, device)  # noqa: E731
        self.norm_embedding = RMSNorm(load("pre_fc_norm_embedding.weight"), cfg.rms_norm_eps)
        self.norm_hidden = RMSNorm(load("pre_fc_norm_hidden.weight"), cfg.rms_norm_eps)
        self.fc_embedding = DenseLinear(source, "mtp.fc_embedding.weight", dtype, device)  # [H, H]
        self.fc_hidden = DenseLinear(source, "mtp.fc_hidden.weight", dtype, device)  # [H, H]
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg, source, routed, cfg.num_hidden_layers + j, f"mtp.layers.{j}.", model.rotary, dtype, device,
            )
            for j in range(cfg.mtp_num_hidden_layers)
        )
        self.final_mixer = GatedResidual(cfg, source, "mtp.hyper_connection_mixer.", dtype, device, inject=False)

    def position(self, state: SequenceState, step: int = 0) -> int:
        """Next position the MTP layer for draft `step` will write."""
        return state.attention[self.layers[step % len(self.layers)].layer].length

    @torch.no_grad()
    def forward(
        self, streams: torch.Tensor, next_tokens: torch.Tensor, state: SequenceState, step: int = 0,
        logits: bool = True,
    ) -> DraftOutput:
        """streams [T, hc*H] (backbone or previous draft step), next_tokens int64 [T] -> DraftOutput.

        Row t pairs the streams of position q + t with the token at q + t + 1, q = self.position(state).
        `logits` False: only the layer's cache is wanted (catching up), the logits are None."""
        cfg = self.config
        next_tokens = next_tokens.to(self.device)
        embedded = self.norm_embedding(F.embedding(next_tokens, self.embed_tokens))
        embedded = self.fc_embedding(embedded)  # [T, H]
        hidden = self.norm_hidden(streams).unflatten(-1, (cfg.hc_count, cfg.hidden_size))
        hidden = self.fc_hidden(hidden).flatten(-2)  # [T, hc*H]
        hidden = self.layers[step % len(self.layers)](hidden, next_tokens, state, pending=embedded)
        if not logits:
            return DraftOutput(logits=None, streams=hidden)
        mixed, _ = self.final_mixer.mix(hidden)
        return DraftOutput(logits=F.linear(mixed, self.lm_head), streams=hidden)
