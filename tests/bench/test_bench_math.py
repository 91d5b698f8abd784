"""The bench's arithmetic by hand: roofline per tier, budget and cost scaling to a full layer count
(evenly, by the layers' own time, or by each layer's kind), the layer clock, store counters per phase, the manifest's
byte sizes, and the prompt."""

from __future__ import annotations

import math
import time

import pytest
import torch

from flashpack.errors import FlashpackError
from flashpack.layout.manifest import Manifest
from flashpack.runtime.bench.clock import BEFORE_LAYERS, BEFORE_LAYERS_HOST, LayerClock, LayerSpan
from flashpack.runtime.bench.emulate import (
    LAYER_KIND_FORMULA,
    LAYER_TIME_FORMULA,
    SCALE_FORMULA,
    LayerKinds,
    check_layers,
    scale_budget,
    scale_by_layer_time,
    scale_to_layers,
    scale_traffic,
)
from flashpack.runtime.bench.phases import difference, phase_summary
from flashpack.runtime.bench.roofline import Traffic, phase_traffic, roofline
from flashpack.runtime.bench.sizes import ModelSizes, baseline_fixed_bytes, model_sizes
from flashpack.runtime.bench.workload import prompt_ids
from flashpack.runtime.store.budget import STAGING_ROW_SETS

SIZES = ModelSizes(layers=2, width=2, layer_dense_each=(400, 600), device_fixed=300, head_read=200, embed_row=10,
                   record_bytes=50, record_stride=64, top_k=2)


def test_phase_traffic_counts_dense_once_per_forward_and_experts_per_request():
    # decode, 4 tokens: 4 forwards x (1000 + 200) + 4 rows x 10 + 16 experts x 50
    decode = phase_traffic(SIZES, forwards=4, tokens=4, requests=16, host_to_device=640, disk_to_host=128)
    assert decode == Traffic(device=5640.0, host_to_device=640.0, disk_to_host=128.0)
    # prefill, 8 tokens in one forward, 3 distinct experts: 1200 + 80 + 150
    prefill = phase_traffic(SIZES, forwards=1, tokens=8, requests=3, host_to_device=0, disk_to_host=0)
    assert prefill.device == 1430.0
    assert decode.per_token(4) == Traffic(1410.0, 160.0, 32.0)


def test_roofline_is_the_slowest_known_tier():
    traffic = Traffic(device=5640.0, host_to_device=640.0, disk_to_host=128.0)
    out = roofline(traffic, {"device": 1000.0, "host_to_device": 100.0, "disk_to_host": None}, tokens=4,
                   achieved_seconds=12.8)
    assert out["seconds"] == {"device": 5.64, "host_to_device": 6.4, "disk_to_host": None}
    assert out["bound"] == "host_to_device"
    assert out["roofline_seconds"] == 6.4 and out["roofline_seconds_per_token"] == 1.6
    assert out["roofline_tokens_per_s"] == 4 / 6.4 == 0.625
    assert out["achieved_tokens_per_s"] == 4 / 12.8
    assert out["achieved_over_roofline"] == 0.5  # 6.4 s of bytes took 12.8 s
    assert math.isclose(out["serial_seconds"], 12.04)
    assert out["bytes_per_token"] == {"device": 1410.0, "host_to_device": 160.0, "disk_to_host": 32.0}
    disk_bound = roofline(traffic, {"device": 1e6, "host_to_device": 1e6, "disk_to_host": 64.0}, tokens=4)
    assert disk_bound["bound"] == "disk_to_host" and disk_bound["roofline_seconds"] == 2.0
    assert disk_bound["achieved_over_roofline"] is None
    with pytest.raises(ValueError):
        roofline(traffic, {"device": None, "host_to_device": None, "disk_to_host": None}, tokens=4)


def test_budget_scaling_keeps_the_fixed_part_and_scales_the_rest():
    # 2000 fixed + (12000 - 2000) * 8 / 48 = 2000 + 1666
    assert scale_budget(12_000, 2_000, 8, 48, "--vram-budget") == 3_666
    assert scale_budget(6_000, 0, 4, 48, "--ram-budget") == 500
    assert scale_budget(None, 2_000, 8, 48, "--vram-budget") is None
    assert scale_budget(12_000, 2_000, 8, 8, "--vram-budget") == 12_000  # not emulating
    with pytest.raises(FlashpackError, match="--vram-budget .* below"):
        scale_budget(1_000, 2_000, 8, 48, "--vram-budget")
    assert check_layers(8, None) == 8 and check_layers(8, 48) == 48
    with pytest.raises(FlashpackError, match="--emulate-layers 4"):
        check_layers(8, 4)


def test_costs_scale_per_layer_around_the_fixed_part():
    # 0.1 s outside the layers, 0.9 s for 4 layers -> 0.1 + 0.9 * 12 at 48 layers
    assert math.isclose(scale_to_layers(1.0, 0.1, 4, 48), 10.9)
    assert scale_to_layers(1.0, 0.1, 4, 4) == 1.0
    scaled = scale_traffic(Traffic(1000.0, 200.0, 40.0), 100.0, 4, 48)
    assert scaled == Traffic(device=100.0 + 900.0 * 12, host_to_device=2400.0, disk_to_host=480.0)
    # 500 of the 900 are the 4 layers' dense bytes, 5000 the 48 layers': the other 400 (experts) scale
    by_kind = scale_traffic(Traffic(1000.0, 200.0, 40.0), 100.0, 4, 48, layer_dense=(500.0, 5000.0))
    assert by_kind == Traffic(device=100.0 + 5000.0 + 400.0 * 12, host_to_device=2400.0, disk_to_host=480.0)


def test_layer_kinds_continue_the_packs_attention_pattern():
    kinds = LayerKinds.of([True, True, True, False], [True, False, False, False], 48)  # the full preset, cut to 4
    assert kinds.pack == ("first", "deltanet", "deltanet", "attention")  # layer 0 is also the PLE layer
    assert len(kinds.tail) == 44 and kinds.tail.count("deltanet") == 33 and kinds.tail.count("attention") == 11
    assert kinds.tail[:4] == ("deltanet", "deltanet", "deltanet", "attention")
    # layer 0 stands for nothing past the pack; DeltaNet is the mean of layers 1 and 2: 33 x 2 + 11 x 3
    assert kinds.tail_sum({0: 100.0, 1: 1.0, 2: 3.0, 3: 3.0}) == 99.0
    assert kinds.tail_sum({0: 1.0, 1: 5.0, 3: 3.0}) is None  # layer 2 not timed (a piece of several layers)
    # a PLE layer past layer 0 is a kind of its own, counted once
    assert LayerKinds.of([True, True, True, False], [False, True, False, False], 48).tail_sum(
        {0: 100.0, 1: 50.0, 2: 2.0, 3: 3.0}) == 99.0
    assert LayerKinds.of([True, True], [False, False], 48).tail is None  # no attention layer: no pattern
    assert LayerKinds.of([True, False, False], [False, False, False], 48).tail is None  # not a pattern
    only_first = LayerKinds.of([True, True, True, False], [False, True, True, False], 8)  # no plain DeltaNet
    assert only_first.tail_sum({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}) is None


def test_decode_from_graphs_scales_only_the_layers_time():
    from flashpack.runtime.bench.bench import _scaled

    # a 1.0 s step of which 0.6 s in the 4 layers -> 1.0 + 0.6 * 44 / 4 at 48 layers
    assert math.isclose(scale_by_layer_time(1.0, 0.6, 4, 48), 7.6)
    assert scale_by_layer_time(1.0, 0.6, 4, 4) == 1.0
    result = {"prefill": {"ttft_s": 2.0, "tokens": 10},
              "decode": {"seconds": 2.0, "tokens": 2, "layer_seconds": 1.2}}
    scaled = _scaled(result, {"prefill": 0.2, "decode": 0.1}, 4, 48)
    assert math.isclose(scaled["decode_ms_per_token"], 7600) and scaled["decode_scaling"] == LAYER_TIME_FORMULA
    assert math.isclose(scaled["decode_ms_per_token_even"], 1000 * (0.1 + 0.9 * 12))
    # each layer timed: layers 4..47 are 33 DeltaNet layers like layers 1 and 2 and 11 attention layers
    # like layer 3; per token 1.0 + 33 * 0.1 + 11 * 0.2
    kinds = LayerKinds.of([True, True, True, False], [True, False, False, False], 48)
    result["decode"]["layer_seconds_each"] = {"0": 0.6, "1": 0.1, "2": 0.3, "3": 0.4}
    by_kind = _scaled(result, {"prefill": 0.2, "decode": 0.1}, 4, 48, kinds)
    assert by_kind["decode_scaling"] == LAYER_KIND_FORMULA and math.isclose(by_kind["decode_ms_per_token"], 6500)
    assert math.isclose(by_kind["decode_ms_per_token_layer_time"], 7600)
    assert _scaled(result, {"prefill": 0.2, "decode": 0.1}, 4, 48)["decode_scaling"] == LAYER_TIME_FORMULA
    result["decode"]["layer_seconds"] = None  # eager decode: the layers were not timed apart
    scaled = _scaled(result, {"prefill": 0.2, "decode": 0.1}, 4, 48)
    assert scaled["decode_ms_per_token"] == scaled["decode_ms_per_token_even"] and scaled["decode_scaling"] == SCALE_FORMULA


def test_the_layers_share_of_decode_belongs_to_the_median_run():
    from flashpack.runtime.bench.run import EngineResult

    result = EngineResult(10, 4, repeats=[
        {"decode_seconds": 1.0, "decode_layer_seconds": {0: 0.1, 1: 0.4, "before": 0.1}},
        {"decode_seconds": 3.0, "decode_layer_seconds": {0: 0.9, 1: 0.9, "before": 0.9}}])
    # median share x median time, layer by layer: (0.1 + 0.3) / 2 and (0.4 + 0.3) / 2 of 2 s
    assert math.isclose(result.decode_seconds_by_layer[0], 0.4) and math.isclose(result.decode_seconds_by_layer[1], 0.7)
    assert math.isclose(result.decode_layer_seconds, 1.1) and math.isclose(result.decode_seconds_before_layers, 0.4)
    result.repeats.append({"decode_seconds": 2.0, "decode_layer_seconds": None})
    assert result.decode_layer_seconds is None


def test_layer_clock_times_each_layer_and_adds_up_its_laps():
    clock = LayerClock(torch.device("cpu"))
    for _ in range(2):  # two steps
        clock.begin()
        time.sleep(0.02)
        clock.lap(0)
        clock.lap(1)
        time.sleep(0.01)
        clock.lap(1)  # a layer lapped twice in a step (the store path's last combine) adds up
    time.sleep(0.3)  # after the last lap: in no layer
    seconds = clock.take()
    assert set(seconds) == {0, 1}
    assert 0.04 <= seconds[0] < 0.3 and 0.02 <= seconds[1] < 0.3
    assert clock.take() == {}
    with pytest.raises(RuntimeError, match="before begin"):
        clock.lap(0)
    clock.step()  # the bench marks the step's start: the host's time before the layers is timed too
    time.sleep(0.02)
    clock.begin()
    clock.lap(0)
    seconds = clock.take()
    assert set(seconds) == {BEFORE_LAYERS, BEFORE_LAYERS_HOST, 0} and 0.02 <= seconds[BEFORE_LAYERS] < 0.3
    assert 0.02 <= seconds[BEFORE_LAYERS_HOST] <= seconds[BEFORE_LAYERS] + 0.01  # on a CPU one clock
    assert clock.take() == {}


class _Layers(torch.nn.Module):
    """Two layers that sleep: a model's shape as LayerSpan hooks it, the first and last layer."""

    device = torch.device("cpu")

    def __init__(self, seconds: float):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Sleep(seconds) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Sleep(torch.nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x


class _Checked:
    """A CheckedGraphs stand-in: its run calls the layers again inside (a nested span, counted once)."""

    def __init__(self, model):
        self.model = model

    def run(self, x):
        time.sleep(0.01)
        return self.model(x)


def test_layer_span_times_the_layers_of_steps_while_on():
    model = _Layers(0.01)
    checked = _Checked(model)
    span = LayerSpan(model, checked)
    model(torch.zeros(1))  # off: not counted
    assert span.take() == 0.0
    span.on = True
    time.sleep(0.05)  # outside the layers: not counted
    model(torch.zeros(1))
    model(torch.zeros(1))
    assert 0.04 <= span.take() < 0.05 + 0.04  # two steps of two 0.01 s layers
    checked.run(torch.zeros(1))  # a chunk: its own 0.01 s and its layers', once
    assert 0.03 <= span.take() < 0.03 + 0.04
    model.layers[0](torch.zeros(1))  # a step cut short (a warm-up's depth): an open span is dropped
    assert span.take() == 0.0
    span.on = False
    model(torch.zeros(1))
    assert span.take() == 0.0


def test_phase_summary_hit_rates_and_per_token_bytes():
    before = {"requests": 5, "device_hits": 1, "host_hits": 2, "disk_reads": 2, "bytes_host_to_device": 100,
              "bytes_disk_to_host": 50, "wait_seconds": 1.0}
    after = {"requests": 15, "device_hits": 5, "host_hits": 5, "disk_reads": 5, "bytes_host_to_device": 740,
             "bytes_disk_to_host": 434, "wait_seconds": 1.5}
    out = phase_summary(difference(before, after), tokens=2)
    assert (out["requests"], out["device_hits"], out["host_hits"], out["disk_reads"]) == (10, 4, 3, 3)
    assert out["hit_rates"] == {"device": 0.4, "host": 0.5, "disk": 0.3}
    assert out["per_token"] == {"requests": 5.0, "disk_reads": 1.5, "bytes_host_to_device": 320.0,
                                "bytes_disk_to_host": 192.0}
    assert out["wait_seconds"] == 0.5
    assert phase_summary({}, tokens=1)["hit_rates"] == {"device": None, "host": None, "disk": None}


def test_sizes_from_the_manifest(tiny_pack):
    manifest = Manifest.load(tiny_pack)
    cfg = manifest.config
    dense = manifest.dense_tensors()
    elements = {name: math.prod(t.shape) for name, t in dense.items()}
    sizes = model_sizes(manifest, torch.float32)
    assert sizes.width == 4 and sizes.layers == cfg.num_hidden_layers == 8
    assert sizes.layer_dense == 4 * sum(n for name, n in elements.items() if name.startswith("layers."))
    outside = 4 * sum(n for name, n in elements.items() if not name.startswith("layers."))
    work = cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    assert sizes.device_fixed == outside + work  # mtp.* included: the store holds it on the device
    mixer = sum(n for name, n in elements.items() if name.startswith("hyper_connection_mixer."))
    assert sizes.head_read == 4 * (elements["lm_head.weight"] + mixer)
    assert sizes.embed_row == 4 * cfg.hidden_size
    assert (sizes.record_bytes, sizes.record_stride) == (3472, 4096)
    on_gpu = model_sizes(manifest, torch.float32, device="cuda")  # the store's staging rows join the fixed part
    assert on_gpu.device_fixed == sizes.device_fixed + STAGING_ROW_SETS * cfg.num_experts_per_tok * sizes.record_stride
    no_mtp = sum(n for name, n in elements.items() if not name.startswith(("layers.", "mtp.")))
    assert baseline_fixed_bytes(manifest, torch.bfloat16) == 2 * no_mtp


class _Tokenizer:
    def __init__(self):
        self.all_special_ids = [0, 1]
        self.added_tokens_decoder = {}

    def __len__(self):
        return 20  # the model's vocabulary is larger: ids 20.. are padding


def test_prompt_is_seeded_and_avoids_special_ids():
    ids = prompt_ids(_Tokenizer(), vocab_size=32, length=500, seed=3, eos_token_id=7)
    assert len(ids) == 500 and set(ids) == set(range(2, 20)) - {7}
    assert ids == prompt_ids(_Tokenizer(), 32, 500, 3, 7)
    assert ids != prompt_ids(_Tokenizer(), 32, 500, 4, 7)
