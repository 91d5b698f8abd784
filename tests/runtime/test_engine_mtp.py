"""The MTP head against an independent reference written from vLLM 0.33's qwen4_exp MTP semantics.

Reference path: the MTP-specific parts as direct formulas (whole-vector zero-centred RMS norms,
fc_embedding, per-stream fc_hidden, the embedding added to every stream with unit weight, i.e.
vLLM's combine with prev_injection=None), then transformers' own Qwen4ExpTextDecoderLayer (QSA +
MoE, loaded with the MTP weights) and GatedResidual as the MTP final mixer, then the shared lm_head.
"""

from __future__ import annotations

import torch
from reference_model import SwappedExperts, prompts, rel_err, tiny_config
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

TOL = 1e-5


def _zero_centred_rms(x, weight, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight.float())


class ReferenceMTP:
    def __init__(self, bench):
        cfg, w = bench.weights.config, bench.mtp_weights
        self.cfg, self.w, self.reference = cfg, w, bench.reference
        layers = cfg.num_hidden_layers
        hf_cfg = tiny_config(num_hidden_layers=layers + 1, layer_types=list(cfg.layer_types) + ["indexed_attention"])
        hf_cfg._attn_implementation = "eager"
        self.layer = hf.Qwen4ExpTextDecoderLayer(hf_cfg, layer_idx=layers).eval()
        state = {}
        for name in self.layer.state_dict():
            if name == "mlp.experts.gate_up_proj":
                state[name] = torch.stack([torch.cat([w[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"],
                                                      w[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"]])
                                           for e in range(cfg.num_experts)])
            elif name == "mlp.experts.down_proj":
                state[name] = torch.stack([w[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"]
                                           for e in range(cfg.num_experts)])
            else:
                state[name] = w["mtp.layers.0." + name]
        self.layer.load_state_dict(state)
        self.mixer = hf.Qwen4ExpTextGatedResidual(hf_cfg, use_combine=False).eval()
        self.mixer.load_state_dict({k: w["mtp.hyper_connection_mixer." + k] for k in self.mixer.state_dict()})

    @torch.no_grad()
    def __call__(self, streams: torch.Tensor, next_tokens: torch.Tensor):
        """streams [T, hc*H] at positions 0..T-1, next_tokens [T] -> (logits [T, V], streams [T, hc*H])."""
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        length, hc, hidden = streams.shape[0], cfg.hc_count, cfg.hidden_size
        embed = self.reference.model.embed_tokens.weight[next_tokens]
        e = _zero_centred_rms(embed, w["mtp.pre_fc_norm_embedding.weight"], eps) @ w["mtp.fc_embedding.weight"].T
        h = _zero_centred_rms(streams, w["mtp.pre_fc_norm_hidden.weight"], eps).view(length, hc, hidden)
        x = (h @ w["mtp.fc_hidden.weight"].T + e[:, None, :]).reshape(1, length, hc * hidden)
        positions = torch.arange(length).view(1, 1, -1).expand(3, 1, -1)
        rope = self.reference.model.rotary_emb(x, positions)
        causal = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = self.layer(x, position_embeddings=rope, attention_mask=causal, past_key_values=None)
        logits = self.mixer(out)[0] @ self.reference.lm_head.weight.T
        return logits, out[0]


def _backbone(engine, tokens):
    state = engine.new_state()
    return engine(torch.tensor(tokens), state).streams, state


def test_mtp_matches_reference_over_a_long_prompt(bench, engine):
    tokens = prompts()["long_72_eos"]
    streams, state = _backbone(engine, tokens)
    mtp = bench.mtp(engine)
    draft = mtp(streams[:-1], torch.tensor(tokens[1:]), state)
    expected_logits, expected_streams = ReferenceMTP(bench)(streams[:-1], torch.tensor(tokens[1:]))
    assert rel_err(draft.logits, expected_logits) <= TOL
    assert rel_err(draft.streams, expected_streams) <= TOL
    assert mtp.position(state) == len(tokens) - 1


def test_mtp_incremental_and_chained_draft_steps(bench, engine):
    tokens = prompts()["long_44"]
    streams, state = _backbone(engine, tokens)
    mtp, reference = bench.mtp(engine), ReferenceMTP(bench)
    nexts = torch.tensor(tokens[1:])
    pieces = [mtp(streams[:20], nexts[:20], state)]
    pieces += [mtp(streams[t:t + 1], nexts[t:t + 1], state) for t in range(20, len(tokens) - 1)]
    expected_logits, _ = reference(streams[:-1], nexts)
    assert rel_err(torch.cat([p.logits for p in pieces]), expected_logits) <= TOL

    # Second draft step: the streams of step one at position p, the drafted token, position p + 1.
    first = mtp(streams[-1:], torch.tensor([17]), state)
    drafted = int(first.logits[-1].argmax())
    second = mtp(first.streams, torch.tensor([drafted]), state)
    chain_streams = torch.cat([streams, first.streams])
    chain_tokens = torch.cat([nexts, torch.tensor([17, drafted])])
    expected_logits, _ = reference(chain_streams, chain_tokens)
    assert rel_err(first.logits, expected_logits[-2:-1]) <= TOL
    assert rel_err(second.logits, expected_logits[-1:]) <= TOL


def test_control_mtp_with_wrong_experts_breaks(bench, engine):
    tokens = prompts()["long_72_eos"]
    streams, state = _backbone(engine, tokens)
    broken_experts = SwappedExperts(bench.experts, layer=bench.weights.config.num_hidden_layers)
    broken = type(bench.mtp(engine))(engine, bench.weights, broken_experts)
    logits = broken(streams[:-1], torch.tensor(tokens[1:]), state).logits
    expected, _ = ReferenceMTP(bench)(streams[:-1], torch.tensor(tokens[1:]))
    assert rel_err(logits, expected) > 1e-2
