"""Prompt-state reuse on an agent-like conversation: the time to first token of each turn with and
without saved states, and of a follow-up after a restart that finds only the stored states.

    python bench/prompt_reuse.py PACK [--device cpu] [--turns 10] [--turn-tokens 500] --json OUT

A conversation of `--turns` user turns, each ~`--turn-tokens` tokens of Python source (from the
installed transformers package: text the demo model knows), each answered greedily with
`--reply-tokens` tokens, the whole history sent again every turn, as agents and chat clients do.
Three engines run it: one with no prompt cache (every turn prefills its whole prompt), one with
live states (each turn restores the previous turn's reply), and, after the second, a fresh engine
on the same stored-states folder that answers the last turn again (a restart: nothing live, the
stored state read, decompressed and restored). Reported per turn: prompt tokens, tokens restored,
TTFT each way; and the saved state's size per 1k tokens of context, in memory and on disk.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import transformers

from flashpack.runtime.bench.machine import machine_info
from flashpack.runtime.engine.build import load_engine, parse_device
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.sampling import SamplingParams


def source_turns(tokenizer, turns: int, tokens: int) -> list[str]:
    """`turns` pieces of Python source of about `tokens` tokens each."""
    text = (Path(transformers.__file__).parent / "generation" / "utils.py").read_text()
    ids = tokenizer.encode(text)
    return [tokenizer.tokenizer.decode(ids[i * tokens:(i + 1) * tokens]) for i in range(turns)]


def conversation(engine, turns: list[str], reply_tokens: int) -> tuple[list[dict], list[dict]]:
    """Each turn's prompt tokens, restored tokens and TTFT; the history grows by each reply."""
    messages = [{"role": "system", "content": "You complete Python code."}]
    rows = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        ids = engine.tokenizer.encode_chat(messages)
        result = engine.generator.generate(ids, SamplingParams(max_tokens=reply_tokens),
                                           checkpoints=engine.tokenizer.message_starts(ids))
        rows.append({"prompt_tokens": len(ids), "cached_tokens": result.cached_tokens,
                     "ttft_s": result.first_token_seconds})
        messages.append({"role": "assistant", "content": result.text})
    return rows, messages


def state_bytes(engine) -> dict:
    """A saved state's bytes: fixed (DeltaNet and PLE states) and per 1k tokens of context (QSA
    keys, values and indexer keys), from states after 1,000 and 2,000 tokens."""
    import torch

    sizes = {}
    for tokens in (1000, 2000):
        state = engine.step.new_state()
        engine.step.forward(torch.arange(tokens) % 1000 + 5, state, last_only=True)
        sizes[tokens] = state.snapshot().nbytes()
    per_1k = sizes[2000] - sizes[1000]
    return {"fixed": sizes[1000] - per_1k, "per_1k_tokens": per_1k}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pack")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--turn-tokens", type=int, default=500)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    base = EngineConfig(device=args.device, cuda_graphs=False)
    with tempfile.TemporaryDirectory(prefix="prompt-states-") as folder:
        cold = load_engine(args.pack, replace(base, prompt_cache_ram=0))
        turns = source_turns(cold.tokenizer, args.turns, args.turn_tokens)
        without, _ = conversation(cold, turns, args.reply_tokens)
        sizes = state_bytes(cold)
        cold.close()
        cached_config = replace(base, prompt_cache_ram="4GiB", prompt_cache_dir=folder)
        warm = load_engine(args.pack, cached_config)
        with_cache, messages = conversation(warm, turns, args.reply_tokens)
        cache = warm.generator.prefix_cache
        cache.stored.flush()
        live = cache.to_dict()
        warm.close()
        restarted = load_engine(args.pack, cached_config)  # nothing live: only the stored states
        ids = restarted.tokenizer.encode_chat(messages[:-1])
        start = time.perf_counter()
        again = restarted.generator.generate(ids, SamplingParams(max_tokens=args.reply_tokens),
                                             checkpoints=restarted.tokenizer.message_starts(ids))
        stored_stats = restarted.generator.prefix_cache.to_dict()
        stored_largest = max((f.stat().st_size for f in Path(folder).rglob("*.fpstate")), default=None)
        restarted.close()
    longest = max(row["prompt_tokens"] for row in with_cache)
    report = {
        "machine": machine_info(parse_device(args.device)),
        "settings": {"pack": args.pack, "device": args.device, "turns": args.turns, "turn_tokens": args.turn_tokens,
                     "reply_tokens": args.reply_tokens},
        "turns": [{**row, "ttft_no_reuse_s": plain["ttft_s"]} for row, plain in zip(with_cache, without)],
        "restart": {"prompt_tokens": len(ids), "cached_tokens": again.cached_tokens, "ttft_s": again.first_token_seconds,
                    "wall_s": time.perf_counter() - start, "stored": stored_stats.get("stored")},
        "entry_bytes": {**sizes, "largest_stored_file": stored_largest, "longest_prompt_tokens": longest,
                        "stored_over_raw": None if stored_largest is None else
                        stored_largest / (sizes["fixed"] + sizes["per_1k_tokens"] * longest / 1000)},
        "live": live,
    }
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print("| turn | prompt tokens | restored | TTFT no reuse s | TTFT reuse s |")
    print("| --- | --- | --- | --- | --- |")
    for number, row in enumerate(report["turns"], 1):
        print(f"| {number} | {row['prompt_tokens']} | {row['cached_tokens']} | {row['ttft_no_reuse_s']:.3f} "
              f"| {row['ttft_s']:.3f} |")
    restart = report["restart"]
    print(f"\nafter a restart (stored states only): {restart['cached_tokens']} of {restart['prompt_tokens']} tokens "
          f"restored, TTFT {restart['ttft_s']:.3f} s")
    entry = report["entry_bytes"]
    print(f"a saved state: {entry['fixed'] / 1e6:.2f} MB + {entry['per_1k_tokens'] / 1e6:.3f} MB per 1k tokens; stored "
          f"(zstd) {entry['stored_over_raw'] or 0:.2f} of that")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
