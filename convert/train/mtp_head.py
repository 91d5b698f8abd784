"""The MTP head as it is trained: vLLM's qwen4_exp MTP, built from transformers' own modules.

transformers has no MTP head; flashpack's engine runs vLLM's ("residual_linear_shared", see
runtime/model/mtp.py). For a backbone position p with pre-final-mixer streams h_p [hc*H] and the
next token x_{p+1}:

    e = fc_embedding(rms(embed(x_{p+1})))                   zero-centred norm over the whole [H]
    s = fc_hidden per stream of rms(h_p)                     norm over the whole [hc*H]
    s = decoder layer (QSA + MoE, no PLE) of s + e           e added to every stream, unit weight
    logits(x_{p+2}) = lm_head(final mixer(s))

The decoder layer, the norms and the final mixer are transformers' Qwen4Exp classes; the token
embedding, rotary embedding and lm_head are the backbone's, shared (passed in, not registered
here, so the state dict holds them once). Parameter names under this module are the checkpoint's
`mtp.*` names without the prefix. tests/train/test_mtp_parity.py checks the logits against the
engine's MTPHead.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

MTP_LAYER_TYPE = "indexed_attention"  # the MTP layer is QSA (vLLM's qwen4_exp MTP)


def mtp_layer_config(config: Qwen4ExpTextConfig, mtp_layers: int) -> Qwen4ExpTextConfig:
    """The backbone's config extended by the MTP layers at indices num_hidden_layers + j, which is
    where the checkpoint and the engine's state number them."""
    extended = copy.deepcopy(config)
    extended.layer_types = list(config.layer_types) + [MTP_LAYER_TYPE] * mtp_layers
    extended.num_hidden_layers = config.num_hidden_layers + mtp_layers
    return extended


class TrainingMTPHead(nn.Module):
    def __init__(self, lm: Qwen4ExpForCausalLM, mtp_layers: int = 1):
        super().__init__()
        config = lm.config
        hidden, streams = config.hidden_size, config.hc_count * config.hidden_size
        self.config = mtp_layer_config(config, mtp_layers)
        self.pre_fc_norm_embedding = hf.Qwen4ExpTextRMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = hf.Qwen4ExpTextRMSNorm(streams, eps=config.rms_norm_eps)
        self.fc_embedding = nn.Linear(hidden, hidden, bias=False)
        self.fc_hidden = nn.Linear(hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            hf.Qwen4ExpTextDecoderLayer(self.config, config.num_hidden_layers + j) for j in range(mtp_layers)
        )
        self.hyper_connection_mixer = hf.Qwen4ExpTextGatedResidual(self.config, use_combine=False)
        self.apply(lm._init_weights)  # transformers' own initialisation of each module kind

    def forward(
        self, lm: Qwen4ExpForCausalLM, streams: torch.Tensor, next_tokens: torch.Tensor, step: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [B, T, hc*H] at positions 0..T-1, next_tokens [B, T] (row p: the token at p + 1)
        -> (logits [B, T, vocab] of the token at p + 2, the MTP layer's output streams)."""
        config = self.config
        batch, length, _ = streams.shape
        embedded = self.fc_embedding(self.pre_fc_norm_embedding(lm.model.embed_tokens(next_tokens)))
        hidden = self.pre_fc_norm_hidden(streams).unflatten(-1, (config.hc_count, config.hidden_size))
        hidden = (self.fc_hidden(hidden) + embedded.unsqueeze(-2)).flatten(-2)

        positions = torch.arange(length, device=streams.device).view(1, 1, -1).expand(3, batch, -1)
        rope = lm.model.rotary_emb(hidden, positions)
        mask = create_causal_mask(
            config=config, inputs_embeds=hidden, attention_mask=None, past_key_values=None,
            position_ids=positions[0], allow_is_causal_skip=False,
        )
        hidden = self.layers[step % len(self.layers)](
            hidden, position_embeddings=rope, attention_mask=mask, past_key_values=None
        )
        return lm.lm_head(self.hyper_connection_mixer(hidden)), hidden
