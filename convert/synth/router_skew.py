"""Realistic expert popularity for a random model: a massive activation plus ranked router biases.

Random routers spread tokens almost uniformly; trained ones do not (see `routing_law`). Routers have
no bias term, so the bias rides on a direction every MoE input shares, the way trained models grow
"massive activations":

  1. every token embedding gets the same positive value `massive` on one channel c (chosen from the
     seed), carrying MASSIVE_ENERGY of an embedding row's energy;
  2. no block writes channel c (its rows of o_proj, out_proj, every down_proj and PLE value_proj are
     zero), so the residual keeps it exactly through every layer;
  3. the MoE pre-norm and input mix pass it undistorted (their channel-c weights are zero, i.e. a
     norm gain of 1 and a mix gate of sigmoid(0)), so the router input's channel c is
     MIX_GATE * massive / rms(stream): the same for every token up to the stream's norm;
  4. router row e gets, on column c, the fitted bias of the popularity rank that a per-layer random
     permutation gives expert e, divided by the predicted channel-c input.

The only prediction is how much energy blocks add to the residual by each layer (`rest_energy`);
it was measured on the tiny and small presets and is checked by a test that runs the transformers
reference with `output_router_logits`. `strength` scales every bias: 0 is uniform routing, 1 the
published curve. The MTP layer gets the same treatment through fc_hidden; its prediction is rougher
(transformers does not run MTP, so it is untested).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from flashpack.convert.synth.init_values import EMBED_STD, WRITER_SUFFIXES, block_seed
from flashpack.convert.synth.routing_law import PopularityLaw, fit_law
from flashpack.layout.model_config import TextConfig

MASSIVE_ENERGY = 0.2
MIX_GATE = 0.5  # sigmoid(0)
NOISE_SCALE = 0.5  # router logit std per unit of normalised non-massive input (random router rows)
PLE_ENERGY = 0.45  # residual energy per channel PLE adds, relative to the embedding's
BLOCK_ENERGY = 0.05  # added per layer at reference depth (writers shrink with depth, see init_values)
MTP_ENERGY = 2.0  # fc_hidden (normalised streams) plus fc_embedding (normalised embedding)
_LAYER = re.compile(r"^(mtp\.)?layers\.(\d+)\.")
# Rows that would write the massive channel into the residual: zeroed so it stays exact.
_CHANNEL_WRITERS = (*WRITER_SUFFIXES, "ple.value_proj.weight")
# Per-stream weights (hc_count x hidden) zeroed on the channel: norm gain 1 + 0, mix gate sigmoid(0).
_STREAM_PASSTHROUGH = ("mlp_hyper_connection.hc_norm.weight", "mlp_hyper_connection.input_mix_weight_up.weight")


@dataclass(frozen=True)
class RouterSkew:
    strength: float
    seed: int
    hidden: int
    hc_count: int
    num_experts: int
    nominal_layers: int
    first_ple_layer: int | None  # zero-based
    channel: int
    massive: float  # value of the massive channel in every embedding row
    law: PopularityLaw

    @classmethod
    def build(cls, cfg: TextConfig, strength: float, seed: int, nominal_layers: int) -> RouterSkew:
        hidden = cfg.hidden_size
        massive = EMBED_STD * math.sqrt(MASSIVE_ENERGY / (1 - MASSIVE_ENERGY) * (hidden - 1))
        # The fit assumes the noise scale of a mid-depth layer; others differ by a few per cent.
        tau = NOISE_SCALE * math.sqrt(1 - _massive_share(massive, hidden, 1 + PLE_ENERGY))
        return cls(
            strength=strength,
            seed=seed,
            hidden=hidden,
            hc_count=cfg.hc_count,
            num_experts=cfg.num_experts,
            nominal_layers=nominal_layers,
            first_ple_layer=min(cfg.ple_layer_ids) - 1 if cfg.ple_layer_ids else None,
            channel=block_seed(seed, "massive_channel", 0) % hidden,
            massive=massive,
            law=fit_law(cfg.num_experts, cfg.num_experts_per_tok, tau, seed=seed),
        )

    def rest_energy(self, layer: int) -> float:
        """Predicted energy per non-massive channel of the residual at `layer`'s MoE input."""
        energy = EMBED_STD**2
        if self.first_ple_layer is not None and layer >= self.first_ple_layer:
            energy += PLE_ENERGY
        return energy + BLOCK_ENERGY * (layer + 0.5) * min(1.0, 8 / self.nominal_layers)

    def mtp_gain(self) -> float:
        """fc_hidden's channel-c gain: gives the MTP streams a massive channel of the backbone's share."""
        final_rms = math.sqrt(
            (self.massive**2 + (self.hidden - 1) * self.rest_energy(self.nominal_layers)) / self.hidden
        )
        target = math.sqrt(MASSIVE_ENERGY / (1 - MASSIVE_ENERGY) * (self.hidden - 1) * MTP_ENERGY)
        return target * final_rms / self.massive

    def router_column(self, layer_key: str, energy: float, massive: float) -> torch.Tensor:
        """float32 [E]: column c of one router, biases in logit units divided by the channel-c input."""
        generator = torch.Generator().manual_seed(block_seed(self.seed, "router_rank/" + layer_key, 0))
        rank_of_expert = torch.randperm(self.num_experts, generator=generator)
        bias = self.law.biases(self.num_experts)[rank_of_expert]
        # bias is in units of the router noise NOISE_SCALE * sqrt(1 - share); the input on channel c is
        # MIX_GATE * sqrt(hidden * share); with share/(1 - share) = massive^2 / ((hidden - 1) * energy):
        per_unit = NOISE_SCALE / MIX_GATE * math.sqrt((self.hidden - 1) * energy / self.hidden) / massive
        return self.strength * bias * per_unit

    def adjust(self, name: str, row_start: int, block: torch.Tensor) -> torch.Tensor:
        c, rows = self.channel, block.shape[0]
        local = c - row_start
        stream_rows = [s * self.hidden + c - row_start for s in range(self.hc_count)]
        stream_rows = [r for r in stream_rows if 0 <= r < rows]
        if name == "embed_tokens.weight":
            block[:, c] = self.massive
        elif name.endswith(_CHANNEL_WRITERS) or name == "mtp.fc_embedding.weight":
            if 0 <= local < rows:
                block[local] = 0
        elif name.endswith(_STREAM_PASSTHROUGH) or name == "mtp.pre_fc_norm_hidden.weight":
            block[stream_rows] = 0
        elif name == "mtp.fc_hidden.weight" and 0 <= local < rows:
            block[local] = 0
            block[local, c] = self.mtp_gain()
        elif name.endswith("mlp.gate.weight"):
            # Large routers arrive in row blocks (experts row_start .. row_start + rows - 1).
            block[:, c] = self._router_column_for(name)[row_start:row_start + rows]
        return block

    def _router_column_for(self, name: str) -> torch.Tensor:
        match = _LAYER.match(name)
        if match is None:
            raise ValueError(f"router {name} outside a decoder layer")
        is_mtp, layer = match.group(1) is not None, int(match.group(2))
        if is_mtp:
            energy = MTP_ENERGY + BLOCK_ENERGY
            massive = math.sqrt(MASSIVE_ENERGY / (1 - MASSIVE_ENERGY) * (self.hidden - 1) * MTP_ENERGY)
            return self.router_column(f"mtp.layers.{layer}", energy, massive)
        return self.router_column(f"layers.{layer}", self.rest_energy(layer), self.massive)


def _massive_share(massive: float, hidden: int, energy: float) -> float:
    return massive**2 / (massive**2 + (hidden - 1) * energy)
