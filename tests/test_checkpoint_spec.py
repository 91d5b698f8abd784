"""checkpoint_spec names and shapes every tensor exactly as transformers' save_pretrained writes it."""

import json

import torch
from safetensors import safe_open

from flashpack.layout.checkpoint_spec import canonical_name, checkpoint_key, iter_specs
from flashpack.layout.model_config import TextConfig


def _transformers_tiny(tmp_path, split_parts: int):
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6,
        num_experts_per_tok=2, hc_lowrank=16, ple_layer_ids=[1], ple_embed_dim=64, heads_per_ngram=2,
        ngram_vocab_size_base=1000, split_ngram_parts=split_parts, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4, eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [4, 2, 2]},
    )
    torch.manual_seed(0)
    Qwen4ExpForCausalLM(config).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def _saved_shapes(path):
    shapes = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def test_spec_matches_transformers_save_pretrained(tmp_path):
    # 7 shards of a 4096-row table split unevenly by torch.chunk: 6 x 586 rows and 1 x 580.
    config = TextConfig.from_checkpoint_config(_transformers_tiny(tmp_path, split_parts=7))
    expected = {checkpoint_key(s.name, "qwen4_exp_text"): s.shape for s in iter_specs(config, with_mtp=False)}
    assert expected == _saved_shapes(tmp_path)


def test_canonical_names_round_trip_both_forms():
    for name in ("layers.2.mlp.gate.weight", "lm_head.weight", "mtp.fc_hidden.weight", "embed_tokens.weight"):
        for form in ("qwen4_exp", "qwen4_exp_text"):
            assert canonical_name(checkpoint_key(name, form)) == name
    assert canonical_name("model.visual.blocks.0.attn.qkv.weight") is None
