"""The bench report: JSON (machine, settings, budgets, ceilings, results, roofline, comparison, notes)
and a table with both engines side by side."""

from __future__ import annotations

import json
from pathlib import Path

from flashpack.runtime.bench.emulate import LAYER_KIND_FORMULA, LAYER_TIME_FORMULA

BENCH_VERSION = 1


def notes(layers: int, target: int, baseline_layers: int | None, scale_formula: str, budget_formula: str) -> list[str]:
    out = [
        ("TTFT: one forward of the whole prompt, including the first token's logits and argmax; "
         "prefill tok/s = prompt tokens / TTFT."),
        ("decode: greedy steps after the first token, one token per forward; tok/s = steps / their total time; "
         "every clock read follows a device synchronize."),
        ("warm-up (untimed): a prompt of other ids of the same length and 2 decode steps, so kernels are compiled "
         "for the prompt's shapes, the decode graphs captured and the store's caches as warm as a running server's; "
         "with --hot-set the store was pre-warmed too."),
        ("store traffic (results.*.store) is the store's own counters over the phase, slot-sized (record_stride); "
         "hit rates: device = device hits / requests, host = host hits / device misses, disk = disk reads / requests."),
        ("roofline: per tier, bytes / measured bandwidth; the bound is the slowest tier; device bytes = dense weights "
         "read once per forward + one embedding row per token + record_bytes per requested expert; "
         "achieved_over_roofline = roofline seconds / measured seconds (1.0 = at the bandwidth limit); no compute "
         "ceiling is modelled, so a prefill far below 1.0 is compute-bound."),
        ("bandwidth.device is a copy's bytes read + written per second; a tier without a bandwidth "
         "(host_to_device on a CPU) is left out of the roofline."),
    ]
    if target != layers:
        out += [
            (f"emulation: the pack has {layers} decoder layers, the budgets were typed for {target}: "
             f"{budget_formula} (fixed: dense tensors outside `layers.*` plus the store's work buffer on the device; "
             "0 for RAM, all of which is expert cache)."),
            (f"per-token numbers at {target} layers: {scale_formula}, with x_fixed the embedding + final mixer + "
             "lm_head timed alone (ours) or the time outside the decoder layers' forward hooks (baseline); bytes "
             "likewise, with the device's fixed part the dense bytes read outside the layers."),
            (f"our decode from CUDA graphs at {target} layers: {LAYER_TIME_FORMULA}, t_layers being the device's time "
             "from the first layer's work to the last's (CUDA events), so a step's own host work (PLE rows, the first "
             "graph launch, the read-back) counts once, not once a layer; with a graph a layer, each layer is timed "
             f"too and the layers past the pack's are counted by kind: {LAYER_KIND_FORMULA} (layer 0 and the PLE "
             "layer, unlike the rest, count once; decode's dense bytes likewise). results.flashpack.scaled."
             "decode_scaling says which was used; decode_ms_per_token_even and decode_ms_per_token_layer_time keep "
             "the other two, for comparison."),
        ]
    if baseline_layers is not None:
        out += [
            (f"baseline: transformers' Qwen4ExpForCausalLM with the pack's first {baseline_layers} decoder layers, "
             "weights dequantised from the pack to the run's dtype, placed by accelerate's device map under the "
             f"same budgets scaled to {baseline_layers} layers ({budget_formula} with the model's non-layer dense "
             "bytes as fixed), dispatched with accelerate's offload hooks; its per-layer time is scaled to the "
             f"other layer counts with {scale_formula}, assuming its first layers cost what an average layer does."),
            ("baseline prompt: the first baseline_prompt_tokens of the same prompt; its n-gram (PLE) table is "
             "looked up from the pack's rows (transformers keeps that table out of the device map too); disk-offloaded "
             "weights are read by accelerate through numpy memmaps, i.e. through the page cache."),
            ("baseline check: our engine cut to the same first layers on the same prompt; logits of the last prompt "
             "position compared (relative Frobenius error, gate 1e-4 and equal argmax in float32; reported only in "
             "bfloat16)."),
        ]
    return out


def write_report(report: dict, path: Path) -> None:
    Path(path).write_text(json.dumps(report, indent=1, default=str))


def _bytes(count: float | None) -> str:
    if count is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count:.0f} B"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e9:.2f} GB/s"


def _num(value, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def table(report: dict) -> str:
    settings, budgets, bw = report["settings"], report["budgets"], report["bandwidth"]
    ours, theirs = report["results"]["flashpack"], report["results"]["transformers"]
    layers, target = settings["pack_layers"], budgets["layers_typed_for"]
    typed, engine = budgets["typed"], budgets["engine"]
    lines = [
        (f"flashpack bench: {settings['pack']} ({settings['device']}, {settings['dtype']}), "
         f"prompt {settings['prompt_tokens']} tokens, {settings['gen_tokens']} decoded, {settings['repeats']} repeat(s)"),
        f"budgets: VRAM {_bytes(typed['vram'])}, RAM {_bytes(typed['ram'])} for {target} layers"
        + (f" -> {_bytes(engine['vram'])}, {_bytes(engine['ram'])} for the pack's {layers}" if target != layers else ""),
        (f"ceilings: device {_rate(bw['device']['bytes_per_s'])} (copy), host->device "
         f"{_rate(bw['host_to_device']['bytes_per_s'])}, disk {_rate(bw['disk']['bytes_per_s'])} "
         f"({'O_DIRECT' if bw['disk']['o_direct'] else 'buffered: ' + str(bw['disk']['fallback_reason'])})"),
        (f"engine: {settings.get('expert_source', '?')}, CUDA graphs {'on' if settings.get('cuda_graphs') else 'off'}"
         f"{' (compiled layers)' if settings.get('compiled_layers') else ''}"
         f"{', %s layer(s) a graph' % settings['layers_per_graph'] if settings.get('layers_per_graph') else ''}, "
         f"next-layer prefetch {'on' if settings.get('prefetch') else 'off'}, "
         f"promotions {'on' if settings.get('promote') else 'off'}"
         f"{', fused hyper-connection mixes' if settings.get('fused_mix') else ''}"),
        "",
    ]
    failed = theirs.get("error") if theirs else None
    if failed:
        theirs = None
    base_layers = theirs["layers"] if theirs else None
    head = f"{'':34} {'flashpack':>14} {'transformers':>14} {'speedup':>12}"
    rows = [("measured layers", str(layers), str(base_layers) if theirs else "-", "")]

    def row(label, mine, other, fmt="{:.3f}", higher_is_better=True):
        ratio = ""
        if mine is not None and other:
            ratio = f"{(mine / other if higher_is_better else other / mine):.2f}x"
        rows.append((label, _num(mine, fmt), _num(other, fmt), ratio))

    base_pack = theirs["scaled"][str(layers)] if theirs else {}
    row(f"TTFT s ({layers} layers)", ours["prefill"]["ttft_s"], base_pack.get("ttft_s"), higher_is_better=False)
    row(f"prefill tok/s ({layers} layers)", ours["prefill"]["tokens_per_s"], base_pack.get("prefill_tokens_per_s"),
        "{:.1f}")
    row(f"decode tok/s ({layers} layers)", ours["decode"]["tokens_per_s"], base_pack.get("decode_tokens_per_s"),
        "{:.2f}")
    row(f"decode ms/token ({layers} layers)", ours["decode"]["ms_per_token"], base_pack.get("decode_ms_per_token"),
        "{:.1f}", higher_is_better=False)
    if target != layers:
        mine = ours["scaled"]
        base_full = theirs["scaled"][str(target)] if theirs else {}
        row(f"TTFT s ({target} layers)", mine["ttft_s"], base_full.get("ttft_s"), higher_is_better=False)
        row(f"decode tok/s ({target} layers)", mine["decode_tokens_per_s"], base_full.get("decode_tokens_per_s"),
            "{:.2f}")
        row(f"decode ms/token ({target} layers)", mine["decode_ms_per_token"], base_full.get("decode_ms_per_token"),
            "{:.1f}", higher_is_better=False)
        if ours["decode"].get("layer_seconds") is not None:
            in_layers = 1000 * ours["decode"]["layer_seconds"] / ours["decode"]["tokens"]
            rows.append((f"decode ms/token in layers ({layers})", _num(in_layers, "{:.2f}"), "", ""))
            if ours["decode"].get("before_layers_seconds") is not None:
                before = 1000 * ours["decode"]["before_layers_seconds"] / ours["decode"]["tokens"]
                rows.append(("decode ms/token before the layers", _num(before, "{:.3f}"), "",
                             "host: token -> 1st layer"))
                if ours["decode"].get("before_layers_host_seconds") is not None:
                    host = 1000 * ours["decode"]["before_layers_host_seconds"] / ours["decode"]["tokens"]
                    rows.append(("  the same on the host's clock", _num(host, "{:.3f}"), "", ""))
            rows.append((f"decode tok/s ({target}, even scaling)", _num(1000 / mine["decode_ms_per_token_even"], "{:.2f}"),
                         "", ""))
            if mine["decode_scaling"] == LAYER_KIND_FORMULA:
                rows.append((f"decode tok/s ({target}, t_layers scaling)",
                             _num(1000 / mine["decode_ms_per_token_layer_time"], "{:.2f}"), "", ""))
                each = ours["decode"]["layer_seconds_each"]
                rows.append((f"decode ms/token by layer ({layers})", " ".join(
                    f"{1000 * each[str(i)] / ours['decode']['tokens']:.3f}" for i in range(layers)), "", ""))
    roof = report["roofline"]
    decode_roof = roof.get(f"decode_at_{target}_layers", roof["decode"])
    rows.append((f"decode roofline tok/s ({target} layers)", _num(decode_roof["roofline_tokens_per_s"], "{:.2f}"),
                 "", f"bound: {decode_roof['bound']}"))
    rows.append(("decode achieved / roofline", _num(decode_roof["achieved_over_roofline"]), "", ""))
    store = ours["decode"]["store"]
    rows.append(("decode device hit rate", _num(store["hit_rates"]["device"]), "", ""))
    table_steps = ours["decode"].get("steps_from_slot_table")
    if table_steps:
        rows.append(("decode steps from the slot table", f"{table_steps['stood']}/{table_steps['steps']}", "",
                     f"tried {table_steps['tried']}"))
        if table_steps.get("predicted"):
            rows.append(("decode next-layer predictions right", _num(table_steps["right"] / table_steps["predicted"]),
                         "", f"of {table_steps['predicted']}"))
        if table_steps.get("ahead", 0) + table_steps.get("late", 0):
            rows.append(("decode RAM experts staged ahead", f"{table_steps['ahead_used']}/{table_steps['ahead']} used",
                         "", f"late {table_steps['late']}"))
    counters = store.get("counters", {})
    if counters.get("prefetch_issued"):
        rows.append(("decode prefetches used", _num(counters.get("prefetch_used", 0) / counters["prefetch_issued"]),
                     "", f"of {counters['prefetch_issued']}"))
    if counters.get("read_ahead_issued"):
        used = counters.get("read_ahead_used", 0) / counters["read_ahead_issued"]
        rows.append(("decode read-aheads used", _num(used), "", f"of {counters['read_ahead_issued']}"))
    rows.append(("decode disk bytes / token", _bytes(store["per_token"]["bytes_disk_to_host"]), "", ""))
    rows.append(("decode host->device bytes / token", _bytes(store["per_token"]["bytes_host_to_device"]), "", ""))
    lines.append(head)
    lines += [f"{label:34} {a:>14} {b:>14} {c:>12}" for label, a, b, c in rows]
    if target != layers:
        lines += ["", f"{target}-layer decode: {ours['scaled']['decode_scaling']} (t_layers: the device's time in the "
                      "layers); even scaling: everything but the embedding and lm_head counted per layer"]
    if failed:
        lines += ["", f"baseline FAILED: {failed}"]
    if theirs:
        check = theirs["check"]
        placed = theirs["placement"]["bytes"]
        lines += [
            "",
            f"baseline: {base_layers} layers, prompt {theirs['prefill']['tokens']} tokens"
            + (" (truncated)" if theirs.get("prompt_truncated") else "")
            + f", {theirs['decode']['tokens']} decoded; weights on device {_bytes(placed['device'])}, "
            f"cpu {_bytes(placed['cpu'])}, disk {_bytes(placed['disk'])}",
            f"same model: logits rel. error {check['rel']:.2e}, first token "
            + ("equal" if check["same_top1"] else f"DIFFERS ({check['ours_top1']} vs {check['baseline_top1']})")
            + ("" if check["passed"] is None else (" - pass" if check["passed"] else " - FAIL")),
        ]
    speculated = ours.get("speculation")
    if speculated:
        stats = speculated["stats"]
        lines += ["", (f"speculation ({' then '.join(speculated['drafters'])}, the policy on): "
                       f"{speculated['tokens_per_s']:.1f} tok/s, {speculated['speedup']:.2f}x plain on the same engine; "
                       f"{stats['steps']} checked steps at {stats['tokens_per_step']:.2f} tokens, {stats['plain_steps']} plain; "
                       f"output {'equal to plain' if speculated['lossless'] else 'DIFFERS from plain'}")]
    return "\n".join(lines)
