"""The bench's JSON as Markdown tables (printed, and written beside the JSON)."""

from __future__ import annotations


def tables(result: dict) -> str:
    return "\n\n".join([_loss(result), _mtp(result), _greedy(result), _lookup(result), _locality(result),
                        _replay(result), _targets(result)]) + "\n"


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _loss(result: dict) -> str:
    part, windows = result["held_out_loss"], result["held_out_windows"]
    rows = [[who, weights, f"{part[key]['loss']:.4f}", f"{part[key]['perplexity']:.3f}", f"{part[key]['top1_accuracy']:.3f}"]
            for who, weights, key in (("transformers", "BF16 snapshot, upcast", "transformers_bf16_snapshot"),
                                      ("flashpack engine", "NVFP4 pack (experts NVFP4, rest BF16)", "flashpack_nvfp4_pack"),
                                      ("flashpack engine", "BF16 snapshot", "flashpack_bf16_snapshot"))]
    rows.append(["unigram", f"training counts ({result['unigram']['train_files']} files)", f"{part['unigram']['loss']:.4f}", "", ""])
    return (f"Held-out loss, nats/token, FP32: {windows['read']} of {windows['of']} windows of {windows['length']} "
            f"({windows['targets']:,} targets)\n\n"
            + _table(["model", "weights", "loss", "perplexity", "top-1"], rows)
            + f"\n\nNVFP4 pack vs transformers: {100 * part['gap_nvfp4_pack_vs_transformers']:+.2f} %; "
              f"engine vs transformers, same weights: {100 * part['gap_engine_vs_transformers_same_weights']:+.5f} %")


def _mtp(result: dict) -> str:
    part, trained = result["held_out_loss"], result["training_record"]
    rows = [[f"engine, {name}", f"{part[key]['mtp_agreement_with_greedy']:.3f}", f"{part[key]['mtp_accuracy']:.3f}",
             part[key]["mtp_positions"]]
            for name, key in (("NVFP4 pack", "flashpack_nvfp4_pack"), ("BF16 snapshot", "flashpack_bf16_snapshot"))]
    rows.append(["trainer (all 219 windows, training-record.json)", f"{trained['mtp_agreement_with_greedy']:.3f}",
                 f"{trained['mtp_accuracy']:.3f}", trained["tokens"]])
    return "MTP head, top-1 on held-out code\n\n" + _table(
        ["head", "agreement with the model's greedy t+2", "accuracy on the true t+2", "positions"], rows)


def _greedy(result: dict) -> str:
    part = result["greedy"]
    rows = []
    for name, key in (("transformers vs engine, the pack's weights (NVFP4 experts) on both", "pack_weights"),
                      ("transformers vs engine, the snapshot's BF16 weights on both", "snapshot_weights"),
                      ("transformers on BF16 vs engine on the NVFP4 pack (information)", "bf16_transformers_vs_nvfp4_pack")):
        c = part[key]
        first = ", ".join(f"step {d['step']}{' (tie)' if d['tie'] else ''}" for d in c["divergences"]) or "-"
        rows.append([name, f"{c['equal']} / {c['total']}", f"{c['prompts_identical']} / {len(part['prompts'])}", first])
    return (f"Greedy tokens, FP32: {len(part['prompts'])} held-out prompts of {part['prompt_tokens']} tokens, "
            f"{part['tokens']} tokens each\n\n" + _table(["comparison", "equal tokens", "prompts identical", "first divergences"], rows))


def _lookup(result: dict) -> str:
    part = result["prompt_lookup"]
    rows = []
    for name, key in (("edit: rename a variable", "edit"), ("plain code continuation", "plain")):
        r = part[key]
        rows.append([name, r["steps"], f"{r['proposed']:.2f}", *(f"{a:.2f}" for a in r["accepted_at_least"]),
                     f"{r['mean_accepted']:.2f}", f"{r['speculative_tokens_per_step']:.2f}"])
    k = part["k"]
    return (f"Prompt lookup (n {part['n_max']} down to 1, k = {k}) against the NVFP4 pack's greedy tokens\n\n"
            + _table(["task", "steps", "proposed", *(f"accepted >= {j}" for j in range(1, k + 1)),
                      "mean accepted", "tokens / verify step"], rows))


def _locality(result: dict) -> str:
    part = result["routing"]
    layers = len(part["locality"]["demo"]["prompt"]["per_layer"])
    rows = [[f"{model} {kind}", *(f"{v:.3f}" for v in part["locality"][model][kind]["per_layer"]),
             f"{part['locality'][model][kind]['mean']:.3f}"]
            for model in ("demo", "synth") for kind in ("prompt", "decode")]
    rows.append(["uniform random", *([""] * layers), f"{part['uniform']:.3f}"])
    return (f"Routing locality: share of a token's experts the token before also used (synth: {part['synth_model']})\n\n"
            + _table(["model, tokens", *(f"layer {i}" for i in range(layers)), "mean"], rows))


def _replay(result: dict) -> str:
    part = result["routing"]["replay"]
    policies = ("lru", "lfu", "lfu-decay", "belady", "belady-global")
    rows = [[capacity, model, *(f"{part[model]['misses_per_token'][capacity][p]:.2f}" for p in policies)]
            for capacity in part["demo"]["misses_per_token"] for model in ("demo", "synth")]
    return (f"Decode misses per token, traces replayed ({part['demo']['decode_tokens']} demo, "
            f"{part['synth']['decode_tokens']} synth decode tokens)\n\n"
            + _table(["slots/layer", "model", "LRU", "LFU", "LFU-decay", "Belady", "Belady, one pool"], rows))


def _targets(result: dict) -> str:
    return "Targets\n\n" + _table(["target", "met"], [[name, "yes" if met else "NO"] for name, met in result["targets"].items()])
