"""`flashpack synth`: layout, loadability in transformers, NVFP4 form, tokenizer, routing skew, memory."""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from flashpack.layout.checkpoint_spec import EXPERT_PROJECTIONS, checkpoint_key, iter_specs
from flashpack.convert.nvfp4 import nvfp4_error_bound
from flashpack.convert.synth import synthesize
from flashpack.convert.synth.nvfp4_experts import expert_key, quantize_expert, quantized_entries
from flashpack.convert.synth.presets import SynthOptions, resolve_plan
from flashpack.convert.synth.routing_law import TARGET_MASS, mass_curve, routing_mass
from flashpack.convert.synth.shard_writer import INDEX_NAME
from flashpack.convert.synth.vision import iter_vision_tensors
from flashpack.errors import FlashpackError
from flashpack.layout.model_config import TextConfig
from flashpack.layout.nvfp4 import dequantize_nvfp4
from safetensors import safe_open

FORMS = ("qwen4_exp", "qwen4_exp_text")
DTYPES = {
    "BF16": torch.bfloat16,
    "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F32": torch.float32,
    "I64": torch.int64,
}


@pytest.fixture(scope="module")
def snapshots(tiny_snapshot, tiny_nvfp4_snapshot, tmp_path_factory) -> dict[tuple[str, str], Path]:
    folder = tmp_path_factory.mktemp("synth")
    return {
        ("qwen4_exp", "bf16"): tiny_snapshot,
        ("qwen4_exp", "nvfp4"): tiny_nvfp4_snapshot,
        ("qwen4_exp_text", "bf16"): synthesize("tiny", folder / "text-bf16", text_only=True),
        ("qwen4_exp_text", "nvfp4"): synthesize("tiny", folder / "text-nvfp4", format="nvfp4", text_only=True),
    }


def read_headers(snapshot: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], str]]:
    """key -> (dtype, shape, shard) through the safetensors library itself."""
    headers = {}
    for shard in sorted(snapshot.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            for key in handle.keys():
                sliced = handle.get_slice(key)
                headers[key] = (DTYPES[sliced.get_dtype()], tuple(sliced.get_shape()), shard.name)
    return headers


def load_tensor(snapshot: Path, key: str) -> torch.Tensor:
    shard = json.loads((snapshot / INDEX_NAME).read_text())["weight_map"][key]
    with safe_open(str(snapshot / shard), framework="pt") as handle:
        return handle.get_tensor(key)


def text_config(snapshot: Path) -> TextConfig:
    return TextConfig.from_checkpoint_config(json.loads((snapshot / "config.json").read_text()))


def expected_layout(snapshot: Path, form: str, fmt: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    config = json.loads((snapshot / "config.json").read_text())
    cfg = text_config(snapshot)
    expected = {}
    for spec in iter_specs(cfg):
        if fmt == "nvfp4" and spec.role == "expert":
            for entry in quantized_entries(spec):
                expected[checkpoint_key(expert_key(spec, entry.suffix), form)] = (entry.dtype, entry.shape)
        else:
            dtype = torch.int64 if spec.role == "ple_buffer" else torch.bfloat16
            expected[checkpoint_key(spec.name, form)] = (dtype, spec.shape)
    if form == "qwen4_exp":
        expected.update({t.key: (torch.bfloat16, t.shape) for t in iter_vision_tensors(config["vision_config"])})
    return expected


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("form", FORMS)
def test_keys_shapes_and_dtypes_follow_the_spec(snapshots, form, fmt):
    snapshot = snapshots[(form, fmt)]
    headers = read_headers(snapshot)
    assert {k: v[:2] for k, v in headers.items()} == expected_layout(snapshot, form, fmt)
    index = json.loads((snapshot / INDEX_NAME).read_text())
    assert index["weight_map"] == {k: v[2] for k, v in headers.items()}
    sizes = {k: torch.empty(v[1], dtype=v[0]).nbytes for k, v in headers.items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert len(set(index["weight_map"].values())) > 2  # the tiny preset shards at 1 MB


@pytest.mark.parametrize("form", FORMS)
def test_config_nesting(snapshots, form):
    config = json.loads((snapshots[(form, "bf16")] / "config.json").read_text())
    text = config if form == "qwen4_exp_text" else config["text_config"]
    assert config["model_type"] == form
    assert text["model_type"] == "qwen4_exp_text" and text["mtp_num_hidden_layers"] == 1
    assert "full_attention" in text["layer_types"] and "indexed_attention" not in text["layer_types"]
    if form == "qwen4_exp":
        assert config["architectures"] == ["Qwen4ExpForConditionalGeneration"]
        assert config["vision_config"]["out_hidden_size"] == text["hidden_size"]
    else:
        assert config["architectures"] == ["Qwen4ExpForCausalLM"] and "vision_config" not in config
    assert config["flashpack_synth"]["preset"] == "tiny"


def test_values_are_the_same_in_every_form_and_format(snapshots):
    for name in ("embed_tokens.weight", "layers.3.self_attn.q_proj.weight", "mtp.fc_hidden.weight"):
        reference = load_tensor(snapshots[("qwen4_exp", "bf16")], checkpoint_key(name, "qwen4_exp"))
        for form, fmt in snapshots:
            assert torch.equal(load_tensor(snapshots[(form, fmt)], checkpoint_key(name, form)), reference)


def test_layers_cut_keeps_values_and_seed_changes_them(tmp_path, snapshots):
    cut = synthesize("tiny", tmp_path / "cut", layers=2, text_only=True)
    other = synthesize("tiny", tmp_path / "other", seed=1, text_only=True)
    full = snapshots[("qwen4_exp_text", "bf16")]
    key = "model.layers.1.linear_attn.in_proj_qkv.weight"
    assert torch.equal(load_tensor(cut, key), load_tensor(full, key))
    assert not torch.equal(load_tensor(other, key), load_tensor(full, key))
    assert text_config(cut).ple_layer_ids == (1,) and text_config(cut).num_hidden_layers == 2


def test_ple_buffers_and_norms_match_transformers(snapshots):
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    snapshot = snapshots[("qwen4_exp_text", "bf16")]
    config = Qwen4ExpTextConfig.from_pretrained(snapshot)
    fresh = Qwen4ExpForCausalLM(config).model.layers[0].ple.ple_embedding
    for buffer in ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes"):
        stored = load_tensor(snapshot, f"model.layers.0.ple.ple_embedding.{buffer}")
        assert stored.dtype == torch.int64 and torch.equal(stored, getattr(fresh, buffer))
    norm = load_tensor(snapshot, "model.layers.0.attn_hyper_connection.hc_norm.weight").float()
    gated = load_tensor(snapshot, "model.layers.0.linear_attn.norm.weight").float()
    assert 0.02 < norm.std() < 0.1 and abs(norm.mean()) < 0.02  # zero-centred: used as (1 + w)
    assert abs(gated.mean() - 1) < 0.05  # used as w


@pytest.mark.parametrize("form", FORMS)
def test_loads_in_transformers_and_runs_past_the_indexer_budget(snapshots, form):
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration

    snapshot = snapshots[(form, "bf16")]
    classes = [Qwen4ExpForCausalLM] + ([Qwen4ExpForConditionalGeneration] if form == "qwen4_exp" else [])
    prompt = torch.randint(0, 900, (1, 40), generator=torch.Generator().manual_seed(0))  # budget is 16
    for model_class in classes:
        model, info = model_class.from_pretrained(snapshot, output_loading_info=True, dtype=torch.float32)
        assert not info["missing_keys"] and not info["mismatched_keys"], info
        assert not info["unexpected_keys"], info  # MTP keys are ignored by transformers' own rule
        with torch.no_grad():
            logits = model(prompt).logits[0]
        assert torch.isfinite(logits).all()
        assert logits.std() > 0.5 and logits.argmax(-1).unique().numel() > 10  # not collapsed


@pytest.mark.parametrize("form", FORMS)
def test_nvfp4_experts_dequantise_to_the_bf16_values(snapshots, form):
    quantized, original = snapshots[(form, "nvfp4")], snapshots[(form, "bf16")]
    cfg = text_config(quantized)
    for name in (
        "layers.0.mlp.experts.3.up_proj",
        "layers.7.mlp.experts.31.down_proj",
        "mtp.layers.0.mlp.experts.0.gate_proj",
    ):
        key = checkpoint_key(name + ".weight", form)
        packed = load_tensor(quantized, key)
        scale = load_tensor(quantized, key + "_scale")
        scale_2 = load_tensor(quantized, key + "_scale_2")
        input_scale = load_tensor(quantized, key[: -len("weight")] + "input_scale")
        assert packed.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn
        assert scale_2.shape == () and input_scale.shape == () and scale_2.dtype == input_scale.dtype == torch.float32
        assert torch.isfinite(scale_2) and scale_2 > 0 and input_scale > 0
        reference = load_tensor(original, key).float()
        error = (dequantize_nvfp4(packed, scale, scale_2) - reference).abs()
        assert (error <= nvfp4_error_bound(reference) + 1e-6).all()
    gate = checkpoint_key("layers.2.mlp.experts.5.gate_proj.weight_scale_2", form)
    up = checkpoint_key("layers.2.mlp.experts.5.up_proj.weight_scale_2", form)
    assert torch.equal(load_tensor(quantized, gate), load_tensor(quantized, up))  # fused w13 share one
    assert cfg.num_experts == 32


def test_nvfp4_experts_are_the_bf16_experts_quantised(snapshots):
    """Byte for byte, so the experts quantised ahead on worker threads land under their own keys."""
    form = "qwen4_exp_text"
    quantized, original = snapshots[(form, "nvfp4")], snapshots[(form, "bf16")]
    for prefix in ("layers.0.mlp.experts.0.", "layers.5.mlp.experts.17.", "mtp.layers.0.mlp.experts.31."):
        bf16 = {p: load_tensor(original, checkpoint_key(f"{prefix}{p}.weight", form)) for p in EXPERT_PROJECTIONS}
        expected = quantize_expert(torch.cat([bf16["gate_proj"], bf16["up_proj"]]), bf16["down_proj"])
        for projection, tensors in expected.items():
            for suffix, want in tensors.items():
                got = load_tensor(quantized, checkpoint_key(f"{prefix}{projection}.{suffix}", form))
                assert got.dtype == want.dtype and got.shape == want.shape, (prefix, projection, suffix)
                assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("form", FORMS)
def test_exclude_modules_name_exactly_the_bf16_modules(snapshots, form):
    snapshot = snapshots[(form, "nvfp4")]
    hf_quant = json.loads((snapshot / "hf_quant_config.json").read_text())
    in_config = json.loads((snapshot / "config.json").read_text())["quantization_config"]
    quant = hf_quant["quantization"]
    assert hf_quant["producer"]["name"] == "modelopt"
    assert quant["quant_algo"] == in_config["quant_algo"] == "NVFP4" and quant["group_size"] == 16
    assert quant["kv_cache_quant_algo"] is None and in_config["quant_method"] == "modelopt"
    assert quant["exclude_modules"] == in_config["exclude_modules"]
    for key, (dtype, _, _) in read_headers(snapshot).items():
        module = key.rsplit(".", 1)[0]
        excluded = any(fnmatch.fnmatch(module, pattern) for pattern in quant["exclude_modules"])
        assert excluded == (".experts." not in key), key
        assert (dtype == torch.bfloat16 or dtype == torch.int64) == excluded, key


@pytest.mark.parametrize("form", FORMS)
def test_tokenizer_loads_and_renders_tools_and_thinking(snapshots, form):
    from transformers import AutoTokenizer

    snapshot = snapshots[(form, "bf16")]
    config = json.loads((snapshot / "config.json").read_text())
    text = config.get("text_config", config)
    generation = json.loads((snapshot / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    assert len(tokenizer) == text["vocab_size"]
    ids = tokenizer.convert_tokens_to_ids
    assert text["eos_token_id"] == ids("<|endoftext|>") and tokenizer.eos_token_id == ids("<|im_end|>")
    assert set(generation["eos_token_id"]) == {ids("<|im_end|>"), ids("<|endoftext|>")}
    if form == "qwen4_exp":
        assert config["image_token_id"] == ids("<|image_pad|>") and config["vision_start_token_id"] == ids(
            "<|vision_start|>"
        )
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"celsius": 21}'},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert rendered.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "get_weather"' in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in rendered
    assert '<|im_start|>user\n<tool_response>\n{"celsius": 21}\n</tool_response><|im_end|>' in rendered
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n")
    encoded = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    assert ids("<tool_call>") in encoded and max(encoded) < text["vocab_size"]
    assert tokenizer.decode(tokenizer("def f(x): return x + 1").input_ids) == "def f(x): return x + 1"


def _measured_curve(snapshot: Path) -> list[float]:
    from transformers import Qwen4ExpForCausalLM

    model = Qwen4ExpForCausalLM.from_pretrained(snapshot, dtype=torch.float32)
    prompt = torch.randint(0, 900, (4, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        router_logits = model(prompt, output_router_logits=True).router_logits
    top_k = model.config.num_experts_per_tok
    curves = torch.tensor([mass_curve(routing_mass(logits, top_k)) for logits in router_logits])
    return curves.mean(0).tolist()


def test_router_skew_follows_the_published_curve_and_off_is_near_uniform(snapshots, tmp_path):
    # Measured through the transformers reference, averaged over the 8 layers, 512 tokens each.
    skewed = _measured_curve(synthesize("tiny", tmp_path / "skewed", router_skew=1.0, text_only=True))
    assert all(abs(got - want) <= 0.05 for got, want in zip(skewed, TARGET_MASS)), skewed
    # Uniform routing puts 1/16 .. 1/2 of the mass on 1/16 .. 1/2 of the experts; 512 tokens of
    # sampling noise add about 0.03 to 0.1 to that.
    plain = _measured_curve(snapshots[("qwen4_exp_text", "bf16")])
    uniform = (1 / 16, 1 / 8, 1 / 4, 171 / 512, 1 / 2)
    assert all(0 <= got - even <= 0.13 for got, even in zip(plain, uniform)), plain


def test_full_preset_streams_in_bounded_memory(tmp_path):
    """Real dims (2560 wide, 248k vocab: 1.3 GB embedding) with one layer; 16 experts instead of 512
    keep the test short (512 would add 10 GB of expert writes, not a different code path). VmHWM of
    the child's own address space is the measure: ru_maxrss survives exec, so it would start at the
    pytest parent's peak (over 1 GB after the server and eval tests)."""
    script = textwrap.dedent(f"""
        import json
        from pathlib import Path
        from flashpack.convert.synth import synthesize
        out = synthesize("full", Path({str(tmp_path / "full")!r}), layers=1, experts=16, ple_rows_per_head=256)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        peak_kb = int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])
        print(json.dumps({{"peak_kb": peak_kb, "bytes": index["metadata"]["total_size"]}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    peak = report["peak_kb"] * 1024
    assert report["bytes"] > 2.5e9
    assert peak < report["bytes"] / 3, report
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    assert config["flashpack_synth"]["ple_shrunk"] and "PLE SHRUNK" in (tmp_path / "full" / "README.md").read_text()
    assert config["text_config"]["hidden_size"] == 2560 and config["text_config"]["ngram_vocab_size_base"] == 256


def test_presets_have_the_promised_shape():
    full = resolve_plan(SynthOptions("full")).cfg
    assert full.num_hidden_layers == 48 and full.layer_types.count("indexed_attention") == 12
    assert (full.num_experts, full.num_experts_per_tok, full.moe_intermediate_size) == (512, 10, 640)
    assert 3 * (2560 * 640 // 2 + 2560 * 640 // 16) == 2_764_800  # one NVFP4 expert
    assert full.rotary_dim <= full.indexer_head_dim and sum(full.mrope_section) * 2 == full.rotary_dim
    tiny = resolve_plan(SynthOptions("tiny")).cfg
    assert tiny.num_hidden_layers >= 8 and tiny.ple_layer_ids == (1,) and tiny.indexer_budget < 40
    assert sum(tiny.mrope_section) * 2 == tiny.rotary_dim <= tiny.indexer_head_dim
    assert (
        resolve_plan(SynthOptions("full")).router_skew == 1.0 and resolve_plan(SynthOptions("tiny")).router_skew == 0.0
    )
    cut = resolve_plan(SynthOptions("full", layers=6)).cfg
    assert cut.layer_types == full.layer_types[:6] and cut.ple_layer_ids == (1,)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"preset": "huge"}, "unknown preset"),
        ({"preset": "tiny", "format": "fp8"}, "unknown format"),
        ({"preset": "tiny", "layers": 0}, "--layers"),
        ({"preset": "tiny", "layers": 9}, "--layers"),
        ({"preset": "tiny", "experts": 2}, "--experts"),
        ({"preset": "tiny", "ple_rows_per_head": 1}, "--ple-rows-per-head"),
        ({"preset": "tiny", "router_skew": -1.0}, "router skew"),
        ({"preset": "tiny", "shard_mb": 0}, "shard size"),
    ],
)
def test_bad_options_are_user_errors(options, message):
    with pytest.raises(FlashpackError, match=message):
        resolve_plan(SynthOptions(**options))


def test_existing_output_needs_force_and_foreign_folders_are_kept(tmp_path, tiny_snapshot):
    out = tmp_path / "snap"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(FlashpackError, match="--force"):
        synthesize("tiny", out, layers=1)
    synthesize("tiny", out, layers=1, force=True)
    assert text_config(out).num_hidden_layers == 1
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FlashpackError, match="refusing"):
        synthesize("tiny", out, layers=1, force=True)
    assert (out / "notes.txt").read_text() == "mine"
