"""The trainer's MTP head computes what flashpack's engine MTP head computes.

A tiny random model (the smoke dimensions, every parameter perturbed so norms and the PLE conv are
not at their zero init) runs its transformers backbone; the training head and the engine's
MTPHead (runtime/model/mtp.py, loaded from the trainer's canonical export through the engine tests'
in-memory weight sources) read the same backbone streams and next tokens, over a sequence past the
QSA budget so the MTP layer's indexer selects. FP32 logits must agree to 1e-4; the controls (tokens
one position off, fc_embedding and fc_hidden swapped in the export) must not.
"""

from __future__ import annotations

import torch
from reference_model import StateDictExperts, StateDictWeights, perturb, rel_err

from flashpack.convert.train.export import mtp_tensors
from flashpack.convert.train.model_config import transformers_config
from flashpack.convert.train.training_model import DemoModel
from flashpack.layout.model_config import TextConfig
from flashpack.runtime.model import MTPHead, Qwen4ExpModel

LENGTH = 41  # the smoke model's QSA budget is 16 tokens in blocks of 4
TOL = 1e-4


def _setup(swap_fc: bool = False):
    torch.manual_seed(0)
    config = transformers_config("smoke")
    config.indexer_n_heads = 8  # few heads make block-score ties at 0, which top-k may break either way
    model = DemoModel(config).eval()
    perturb(model, seed=5)
    cfg = TextConfig.from_text_dict(config.to_dict())
    mtp = mtp_tensors(model.mtp, cfg)
    if swap_fc:
        mtp["mtp.fc_embedding.weight"], mtp["mtp.fc_hidden.weight"] = mtp["mtp.fc_hidden.weight"], mtp["mtp.fc_embedding.weight"]
    weights, experts = StateDictWeights(model.lm, mtp), StateDictExperts(model.lm, mtp)
    engine = Qwen4ExpModel(weights, experts, dtype=torch.float32, device="cpu")
    tokens = torch.randint(0, 992, (1, LENGTH + 2), generator=torch.Generator().manual_seed(2))
    tokens[0, 17] = cfg.eos_token_id  # a document boundary inside (PLE n-grams restart)
    return model, engine, MTPHead(engine, weights, experts), tokens


@torch.no_grad()
def _both(model, engine, engine_mtp, tokens, engine_next=None):
    _, streams = model.backbone(tokens[:, :LENGTH])
    ours, ours_streams = model.mtp(model.lm, streams, tokens[:, 1 : LENGTH + 1])
    next_tokens = tokens[0, 1 : LENGTH + 1] if engine_next is None else engine_next
    theirs = engine_mtp(streams[0], next_tokens, engine.new_state())
    return ours[0], ours_streams[0], theirs


def test_training_mtp_head_matches_engine_logits():
    model, engine, engine_mtp, tokens = _setup()
    ours, ours_streams, theirs = _both(model, engine, engine_mtp, tokens)
    assert ours.shape == theirs.logits.shape == (LENGTH, 1024)
    assert rel_err(ours, theirs.logits) <= TOL
    assert rel_err(ours_streams, theirs.streams) <= TOL
    # The backbone streams the head reads are the engine's own to the same tolerance.
    with torch.no_grad():
        _, streams = model.backbone(tokens[:, :LENGTH])
    assert rel_err(streams[0], engine(tokens[0, :LENGTH], engine.new_state()).streams) <= TOL


def test_control_next_tokens_one_position_off_breaks():
    model, engine, engine_mtp, tokens = _setup()
    ours, _, theirs = _both(model, engine, engine_mtp, tokens, engine_next=tokens[0, :LENGTH])
    assert rel_err(ours, theirs.logits) > 1e-2


def test_control_swapped_projections_break():
    model, engine, engine_mtp, tokens = _setup(swap_fc=True)
    ours, _, theirs = _both(model, engine, engine_mtp, tokens)
    assert rel_err(ours, theirs.logits) > 1e-2
