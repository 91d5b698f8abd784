"""The `flashpack` command. Each subcommand is thin: parse flags, call one keyword function."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from flashpack import __version__
from flashpack.errors import FlashpackError, one_line_errors


_BUDGET_OPTIONS = [
    click.option("--vram-budget", help="Device memory for experts and everything else, e.g. 24GiB. On a GPU "
                 "the default is 90% of its free memory; on a CPU without budgets experts are decoded "
                 "straight from the pack."),
    click.option("--ram-budget", help="Pinned host memory for the expert cache, e.g. 64GiB (default on a GPU: "
                 "75% of the available RAM)."),
]


def _with(options: list, command):
    for option in reversed(options):
        command = option(command)
    return command


def _budget_options(command):
    """--vram-budget and --ram-budget: a workload run (profile, trace record) goes through the store."""
    return _with(_BUDGET_OPTIONS, command)


def _store_options(command):
    """The budgets, --policy, --hot-set, --no-direct-io, --no-verify-records, --set."""
    return _with(_BUDGET_OPTIONS + [
        click.option("--policy", type=click.Choice(["lfu", "lru", "lfu-decay"]), help="Eviction policy of the "
                     "expert tiers [default: lfu]; on a CPU, giving it (or any store option) routes experts "
                     "through the store."),
        click.option("--hot-set", help="Pre-warm VRAM, then RAM, from this manifest profile (flashpack profile); "
                     "'*' pre-warms every record the two tiers hold."),
        click.option("--no-direct-io", is_flag=True, help="Read records through the page cache, not O_DIRECT."),
        click.option("--no-verify-records", is_flag=True, help="Skip the xxh64 check of records on first read."),
        click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help="Any engine setting by name, "
                     "store.KEY for the store's (repeatable; README: Configuration). Applied after the other flags."),
    ], command)


_SPECULATE = click.option(
    "--speculate", type=click.Choice(["auto", "mtp", "lookup", "off"]), help="Speculative decoding: drafts checked "
    "in one step, lossless, while that is measured to pay. lookup: drafts copied from the context; mtp: drafted by "
    "the pack's MTP head; auto: both, the MTP head where the pack has one [default: auto].")


def _prompt_cache_options(serving: bool):
    """--prompt-cache-ram, --prompt-cache-dir, --prompt-cache-disk (and for serve --no-prompt-cache-dir)."""
    where = ("default: prompt-states/ in flashpack's cache folder, ~/.cache/flashpack (FLASHPACK_CACHE_DIR), so "
             "a restart finds them; --no-prompt-cache-dir keeps them in RAM only" if serving else "default: none")
    options = [
        click.option("--prompt-cache-ram", help="Host memory for saved prompt states, e.g. 4GiB; 0 turns prompt reuse "
                     "off (default: on a GPU what the RAM budget leaves beyond the experts' records, at least one "
                     "32k-token state, at most a tenth of it; on a CPU 1GiB)."),
        click.option("--prompt-cache-dir", type=click.Path(path_type=Path), help="Keep saved prompt states here "
                     f"across restarts, zstd-compressed ({where})."),
        click.option("--prompt-cache-disk", default="20GiB", show_default=True,
                     help="Disk budget of --prompt-cache-dir; the least recently used states go first."),
    ]
    if serving:
        options.append(click.option("--no-prompt-cache-dir", is_flag=True, help="Keep no prompt states on disk."))
    return lambda command: _with(options, command)


def _prompt_cache_settings(ram: str | None, folder: Path | None, disk: str, serving: bool, no_folder: bool = False
                           ) -> dict:
    """The prompt cache's EngineConfig fields from its flags: serve keeps states under the cache root;
    a one-shot run keeps none unless it is given a folder to find them in later."""
    from flashpack.runtime.compile_cache import cache_root

    if folder is None and serving and not no_folder:
        folder = cache_root() / "prompt-states"
    if ram is None and folder is None and not serving:
        ram = "0"
    return {"prompt_cache_ram": ram, "prompt_cache_dir": None if folder is None or no_folder else str(folder),
            "prompt_cache_disk": disk}


def _engine_config(device: str, dtype: str, vram_budget: str | None = None, ram_budget: str | None = None,
                   policy: str | None = None, hot_set: str | None = None, no_direct_io: bool = False,
                   no_verify_records: bool = False, settings: tuple[str, ...] = (), speculate: str | None = None,
                   **engine):
    """The EngineConfig the flags name: the store's flags into its StoreConfig, `engine` (EngineConfig
    fields) as given, then each --set on top."""
    from flashpack.runtime.engine.config import EngineConfig
    from flashpack.runtime.engine.settings import with_settings
    from flashpack.runtime.store.config import StoreConfig

    store = StoreConfig(vram_budget=vram_budget, ram_budget=ram_budget, hot_set=hot_set, direct_io=not no_direct_io,
                        verify_records=not no_verify_records, **({"policy": policy} if policy is not None else {}))
    if speculate is not None:
        engine["speculate"] = speculate
    return with_settings(EngineConfig(device=device, dtype=dtype, store=store, **engine), settings)


@click.group()
@click.version_option(__version__, prog_name="flashpack")
def main() -> None:
    """Run Qwen3.8-Flash-Next from a tiered expert pack."""
    from flashpack.runtime.compile_cache import use_persistent_compile_caches

    use_persistent_compile_caches()


@main.command()
@click.argument("preset", type=click.Choice(["tiny", "small", "full"]))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--format", "weight_format", type=click.Choice(["bf16", "nvfp4"]), default="bf16", show_default=True,
              help="bf16, or the ModelOpt NVFP4 form (quantised routed and MTP experts).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--layers", type=int, help="Cut the layer count (keeps the 3 linear + 1 attention pattern).")
@click.option("--router-skew", type=float, help="Expert popularity per layer: 0 uniform, 1 the published curve "
              "(default: the preset's; off for tiny).")
@click.option("--text-only", is_flag=True, help="Write the qwen4_exp_text form (no vision, keys under model.).")
@click.option("--experts", type=int, help="Cut the routed-expert count (quick demos of full width).")
@click.option("--ple-rows-per-head", type=int, help="Shrink the PLE tables (full preset) so they fit a small disk; "
              "a token still reads the same number of rows.")
@click.option("--shard-mb", type=float, help="Checkpoint shard size (default: the preset's).")
@click.option("--fast-experts", is_flag=True, help="With --format nvfp4: draw the experts' NVFP4 blocks from "
              "quantised reference blocks instead of sampling and quantising each (~20x faster; same bytes, "
              "magnitudes and routing; for benchmark packs).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@one_line_errors
def synth(preset: str, out: Path, weight_format: str, seed: int, layers: int | None, experts: int | None,
          router_skew: float | None, text_only: bool, ple_rows_per_head: int | None, shard_mb: float | None,
          fast_experts: bool, force: bool) -> None:
    """Write a random Hugging Face-style snapshot of PRESET (tiny, small, full) to OUT."""
    from flashpack.convert.synth import synthesize

    path = synthesize(preset, out, format=weight_format, seed=seed, layers=layers, experts=experts,
                      router_skew=router_skew, text_only=text_only, ple_rows_per_head=ple_rows_per_head,
                      shard_mb=shard_mb, fast_experts=fast_experts, force=force)
    click.echo(f"wrote {path}")


@main.command()
@click.argument("source")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--revision", help="Hub revision (branch, tag or commit) when SOURCE is a repo id.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--dense-fp8", is_flag=True, help="Store large dense matrices as FP8 with one scale per row.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@one_line_errors
def convert(source: str, out: Path, revision: str | None, force: bool, dense_fp8: bool, quiet: bool) -> None:
    """Repack a Hugging Face checkpoint (SOURCE: directory or hub repo id) into a pack at OUT."""
    from flashpack.convert.pipeline import convert as run_convert

    pack = run_convert(source, out, revision=revision, force=force, dense_fp8=dense_fp8, progress=not quiet)
    click.echo(f"wrote {pack}")


@main.command()
@click.argument("pack", type=click.Path(path_type=Path))
@click.option("--check", is_flag=True, help="Verify every byte: the manifest's hash and numbers, every file's "
              "xxh64, every block, every expert record.")
@one_line_errors
def inspect(pack: Path, check: bool) -> None:
    """Show what PACK holds; with --check, verify all of it and name every problem."""
    from flashpack.errors import PackDamageError
    from flashpack.layout.inspect import summarize
    from flashpack.layout.integrity import check_pack
    from flashpack.layout.pack import Pack

    if not check:
        for line in summarize(Pack.open(pack)).lines():
            click.echo(line)
        return
    report = check_pack(pack)
    try:
        summary = summarize(report.pack).lines()
    except FlashpackError:  # a manifest too damaged to summarise: its problems below say why
        summary = []
    for line in summary:
        click.echo(line)
    for line in report.problems:
        click.echo(line, err=True)
    if not report.passed:
        raise PackDamageError(f"{len(report.problems)} problem(s) found in {pack}: the pack is damaged")
    for line in report.checked:
        click.echo(line)


@main.command()
@click.argument("pack", type=click.Path(path_type=Path))
@click.option("--reference", required=True, help="The source snapshot (directory or hub repo id) the pack came from.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Our engine's compute dtype; the reference always runs FP32.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable); default: random sequences "
              "long enough to engage the QSA indexer and PLE.")
@click.option("--decode-tokens", type=int, default=8, show_default=True, help="Teacher-forced decode steps.")
@click.option("--control", type=click.Choice(["swap-nibbles", "zero-experts", "shift-scales"]),
              help="Verify a deliberately broken copy instead: it must fail.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the full report as JSON.")
@click.option("--seed", type=int, default=0, show_default=True)
@one_line_errors
def verify(pack: Path, reference: str, dtype: str, device: str, prompts: tuple[str, ...], decode_tokens: int,
           control: str | None, json_path: Path | None, seed: int) -> None:
    """Compare every layer of PACK run by our engine with transformers fed the same weights."""
    from flashpack.verify import verify_pack

    report = verify_pack(pack, reference, dtype=dtype, device=device, prompts=list(prompts) or None,
                         decode_tokens=decode_tokens, control=control, json_path=json_path, seed=seed, progress=True)
    click.echo(report.table())
    if not report.passed:
        sys.exit(1)


@main.command()
@click.argument("pack", type=click.Path(path_type=Path))
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Wrap PROMPT as a user message with the pack's chat template.")
@click.option("--think/--no-think", default=None, help="The chat template's thinking switch.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", type=int, default=0)
@click.option("--top-p", type=float, default=1.0)
@click.option("--seed", type=int)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="auto", show_default=True, help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float32.")
@_store_options
@_prompt_cache_options(serving=False)
@_SPECULATE
@click.option("--store-stats", is_flag=True, help="Print the expert store's counters (JSON) on stderr at the end.")
@click.option("--cuda-graphs", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Decode from CUDA graphs on a GPU. auto: when --max-tokens times the model's layers pays for "
              "building them (2,048: from 43 tokens at 48 layers; EngineConfig.graphs_min_layer_tokens); off "
              "decodes eagerly.")
@one_line_errors
def run(pack: Path, prompt: str, chat: bool, think: bool | None, max_tokens: int, temperature: float, top_k: int,
        top_p: float, seed: int | None, stop: tuple[str, ...], device: str, dtype: str, vram_budget: str | None,
        ram_budget: str | None, policy: str | None, hot_set: str | None, no_direct_io: bool, no_verify_records: bool,
        settings: tuple[str, ...], prompt_cache_ram: str | None, prompt_cache_dir: Path | None, prompt_cache_disk: str,
        speculate: str | None, store_stats: bool, cuda_graphs: str) -> None:
    """Generate from PACK for PROMPT, streaming text to stdout; tokens/s on stderr at the end."""
    import json

    from flashpack.runtime.engine.build import load_engine
    from flashpack.runtime.sampling import SamplingParams

    config = _engine_config(device, dtype, vram_budget, ram_budget, policy, hot_set, no_direct_io, no_verify_records,
                            settings, speculate, cuda_graphs=cuda_graphs != "off",
                            **_prompt_cache_settings(prompt_cache_ram, prompt_cache_dir, prompt_cache_disk, serving=False))
    engine = load_engine(pack, config, decode_tokens=max_tokens if cuda_graphs == "auto" else None)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stop_strings=stop)
    turn = [{"role": "user", "content": prompt}]
    prompt_ids = engine.tokenizer.encode_chat(turn, enable_thinking=think) if chat else engine.tokenizer.encode(prompt)
    generated = 0
    for event in engine.generator.stream(prompt_ids, params):
        click.echo(event.text, nl=False)
        generated += event.token_id is not None
        if event.finish_reason:
            timings = event.timings
            decode_time = timings["total_seconds"] - timings["first_token_seconds"]
            rate = (generated - 1) / decode_time if generated > 1 and decode_time > 0 else 0.0
            click.echo("")
            click.echo(
                f"[{len(prompt_ids)} prompt tokens, {generated} generated, first token {timings['first_token_seconds']:.2f} s, "
                f"{rate:.1f} tok/s decode, finish: {event.finish_reason}]", err=True,
            )
    if store_stats and engine.store is not None:
        engine.store.stats.tokens = len(prompt_ids) + generated
        click.echo(json.dumps(engine.stats(), indent=1), err=True)


class _OneLineOptionError(click.ClickException):
    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class _OneLineOptionErrors(click.Command):
    """A bad option prints one line and exits 2, as the command's other errors do (not click's usage block)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as error:
            raise _OneLineOptionError(error.format_message()) from None


_POSITIVE_SECONDS = click.FloatRange(min=0, min_open=True)


@main.command(cls=_OneLineOptionErrors)
@click.argument("pack", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Loopback unless you say otherwise.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--api-key", envvar="FLASHPACK_API_KEY", help="Required on every route but /health (or $FLASHPACK_API_KEY).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--model-name", help="The model id clients use (default: the model's name: the source repo id, "
              "else its config's name, else the source folder).")
@click.option("--max-request-bytes", type=click.IntRange(min=1024),
              help="Bodies above this get a 413 (default: 1 MiB + 8 bytes per context token).")
@click.option("--max-queue", type=click.IntRange(min=0), help="Waiting requests before a 429 (default: 16).")
@click.option("--max-context", type=click.IntRange(min=2), help="Prompt + completion token limit (default: the model's).")
@click.option("--default-max-tokens", type=click.IntRange(min=1), help="max_tokens when a request gives none.")
@click.option("--max-connections", type=click.IntRange(min=1), help="Open connections (default: 512, kept below "
              "the open-file limit); beyond it the longest-idle one is closed, or with none idle a 503.")
@click.option("--header-timeout", type=_POSITIVE_SECONDS, help="Seconds a connection has to send a whole "
              "request head (default: 10).")
@click.option("--keep-alive-timeout", type=_POSITIVE_SECONDS, help="Seconds an idle keep-alive connection "
              "stays open (default: 5).")
@click.option("--body-timeout", type=_POSITIVE_SECONDS, help="Seconds a request body may pause between chunks "
              "before a 408 (default: 30).")
@click.option("--max-header-bytes", type=click.IntRange(min=1024), help="Largest request head (default: 16384).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug", "trace"]),
              default="info", show_default=True)
@_store_options
@_prompt_cache_options(serving=True)
@_SPECULATE
@one_line_errors
def serve(pack: Path, host: str, port: int, api_key: str | None, device: str, dtype: str, model_name: str | None,
          max_request_bytes: int | None, max_queue: int | None, max_context: int | None,
          default_max_tokens: int | None, max_connections: int | None, header_timeout: float | None,
          keep_alive_timeout: float | None, body_timeout: float | None, max_header_bytes: int | None,
          log_level: str, vram_budget: str | None, ram_budget: str | None, policy: str | None, hot_set: str | None,
          no_direct_io: bool, no_verify_records: bool, settings: tuple[str, ...], prompt_cache_ram: str | None,
          prompt_cache_dir: Path | None, prompt_cache_disk: str, no_prompt_cache_dir: bool, speculate: str | None) -> None:
    """Serve PACK over OpenAI- and Anthropic-compatible HTTP APIs. Every option is checked before the
    model loads."""
    import socket

    from flashpack.runtime.server import ServerSettings
    from flashpack.runtime.server import serve as run_server
    from flashpack.runtime.server.model_name import pack_model_name
    from flashpack.runtime.store.budget import parse_budget

    parse_budget(vram_budget, "--vram-budget")
    parse_budget(ram_budget, "--ram-budget")
    config = _engine_config(device, dtype, vram_budget, ram_budget, policy, hot_set, no_direct_io, no_verify_records,
                            settings, speculate, **_prompt_cache_settings(prompt_cache_ram, prompt_cache_dir,
                                                                          prompt_cache_disk, serving=True,
                                                                          no_folder=no_prompt_cache_dir))
    try:  # the address resolves and is free to listen on (uvicorn binds it again once the model is loaded)
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except (OSError, UnicodeError) as error:
        raise FlashpackError(f"cannot serve on {host}:{port}: {error.strerror or error}") from None
    given = {"max_request_bytes": max_request_bytes, "max_queue": max_queue, "max_context": max_context,
             "default_max_tokens": default_max_tokens, "max_connections": max_connections,
             "header_timeout": header_timeout, "keep_alive_timeout": keep_alive_timeout,
             "body_timeout": body_timeout, "max_header_bytes": max_header_bytes}
    server = ServerSettings(model_name=model_name if model_name is not None else pack_model_name(pack),
                            api_key=api_key, **{name: value for name, value in given.items() if value is not None})
    run_server(pack, server, config, host=host, port=port, log_level=log_level)


@main.command()
@click.argument("pack", type=click.Path(path_type=Path))
@click.option("--workload", type=click.Path(path_type=Path), required=True,
              help="JSON lines: {\"prompt\": ...} or {\"messages\": [...]}, optional \"max_tokens\".")
@click.option("--name", required=True, help="The hot set's name in the manifest.")
@click.option("--reorder", is_flag=True, help="Rewrite record files so each layer's hot experts are contiguous.")
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--trace-out", type=click.Path(path_type=Path), help="Also save the routing trace here.")
@_budget_options
@one_line_errors
def profile(pack: Path, workload: Path, name: str, reorder: bool, max_tokens: int, device: str, dtype: str,
            trace_out: Path | None, vram_budget: str | None, ram_budget: str | None) -> None:
    """Run a workload on PACK and bake its hot expert set into the manifest."""
    from flashpack.runtime.engine.profile import profile_pack

    result = profile_pack(pack, workload, name, _engine_config(device, dtype, vram_budget, ram_budget), reorder=reorder,
                          max_tokens=max_tokens, trace_out=trace_out)
    hot = [len(layer["experts"]) for layer in result["layers"]]
    moved = f"; {sum(result['moved'].values())} records moved" if reorder else ""
    click.echo(f"hot set {name!r} written: {len(hot)} layers, {min(hot)}-{max(hot)} experts each{moved}")


@main.group()
def trace() -> None:
    """Record routing traces and replay them through cache policies against Belady's optimum."""


@trace.command("record")
@click.argument("pack", type=click.Path(path_type=Path))
@click.option("--workload", type=click.Path(path_type=Path), required=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@_budget_options
@one_line_errors
def trace_record(pack: Path, workload: Path, out: Path, max_tokens: int, device: str, dtype: str,
                 vram_budget: str | None, ram_budget: str | None) -> None:
    """Run WORKLOAD on PACK and save every layer's expert requests."""
    from flashpack.runtime.engine.profile import record_trace

    recorded = record_trace(pack, workload, out, _engine_config(device, dtype, vram_budget, ram_budget),
                            max_tokens=max_tokens)
    click.echo(f"wrote {out} ({recorded.tokens()} tokens)")


@trace.command("replay")
@click.argument("trace_file", type=click.Path(path_type=Path))
@click.option("--capacity", "capacities", type=int, multiple=True, required=True, help="Slots per layer (repeatable).")
@click.option("--policy", "policies", multiple=True, help="lru, lfu, lfu-decay (repeatable; default: all).")
@click.option("--no-adaptive", is_flag=True, help="Leave out the per-layer rebalancing variant.")
@click.option("--decode-only", is_flag=True, help="Count decode steps only, not prompt fetches.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the report as JSON.")
@one_line_errors
def trace_replay(trace_file: Path, capacities: tuple[int, ...], policies: tuple[str, ...], no_adaptive: bool,
                 decode_only: bool, json_path: Path | None) -> None:
    """Misses of each policy at each capacity against Belady's optimum, per layer and in total."""
    import json

    from flashpack.runtime.store import replay_trace

    report = replay_trace(trace_file, capacities, list(policies) or None, adaptive=not no_adaptive,
                          decode_only=decode_only)
    click.echo(report.table())
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_dict(), indent=1))


@main.command()
@click.argument("pack", type=click.Path(path_type=Path))
@_store_options
@click.option("--prompt-len", type=int, default=512, show_default=True, help="Prompt tokens (ids drawn from the vocabulary).")
@click.option("--gen", type=int, default=64, show_default=True, help="Greedy decode steps after the first token.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the full report as JSON.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="auto", show_default=True, help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float32.")
@click.option("--emulate-layers", type=int, help="The full model's decoder layers: budgets are for it, scaled to the "
              "pack's layers, and per-token numbers are also reported at this count.")
@click.option("--baseline", type=click.Choice(["transformers"]), help="Also time transformers + accelerate offload "
              "at the same budget.")
@click.option("--baseline-layers", type=int, default=2, show_default=True, help="Decoder layers the baseline builds.")
@click.option("--baseline-prompt-len", type=int, default=512, show_default=True,
              help="The baseline prefills at most this many of the prompt's tokens.")
@click.option("--baseline-gen", type=int, default=4, show_default=True, help="Baseline decode steps.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the prompt.")
@click.option("--repeats", type=int, default=1, show_default=True, help="Timed prefill + decode runs (medians).")
@click.option("--copy-probe", help="Size of the device-copy bandwidth probe (default 1GiB on a GPU, 256MiB on a CPU).")
@click.option("--disk-probe", default="2GiB", show_default=True, help="At most this much of the expert files is "
              "read to measure the disk.")
@click.option("--offload-dir", type=click.Path(path_type=Path), help="Where the baseline's disk offload goes "
              "(default: beside the pack).")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--no-cuda-graphs", is_flag=True, help="Issue every decode kernel from Python (for comparison).")
@click.option("--no-compile", is_flag=True, help="Capture the decode graphs without torch.compile's fused kernels.")
@click.option("--graph-layers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Decoder layers per CUDA graph of a decode step (the GPU runs one while the host launches the next).")
@click.option("--no-prefetch", is_flag=True, help="Do not prefetch the next layer's predicted experts.")
@click.option("--read-ahead/--no-read-ahead", default=True, show_default=True,
              help="Also read the disk records the layer after next is predicted to pick into RAM.")
@click.option("--promote", is_flag=True, help="Move an expert a decode step staged from RAM into a device slot "
              "once the device policy ranks it above its victim (off by default: on the H200 it halved 24/64 decode).")
@click.option("--no-fused-mix", is_flag=True, help="Run one-token hyper-connection mixes as the module's code, "
              "compiled, instead of two Triton kernels each (for comparison; the kernels are used on a GPU only).")
@click.option("--preset", "presets", multiple=True, metavar="NAME", help="A named experiment: its --set settings "
              "(runtime/bench/presets.py; repeatable), applied before --set.")
@click.option("--speculate", type=click.Choice(["auto", "mtp", "lookup", "off"]), default="off", show_default=True,
              help="Also time decode with these drafters checked in one step as run and serve do (the policy on), "
                   "on the same engine: its plain figures then include what the drafters' store share costs.")
@one_line_errors
def bench(pack: Path, vram_budget: str | None, ram_budget: str | None, policy: str | None, hot_set: str | None,
          no_direct_io: bool, no_verify_records: bool, settings: tuple[str, ...], prompt_len: int, gen: int, json_path: Path | None, device: str,
          dtype: str, emulate_layers: int | None, baseline: str | None, baseline_layers: int, baseline_prompt_len: int,
          baseline_gen: int, seed: int, repeats: int, copy_probe: str | None, disk_probe: str,
          offload_dir: Path | None, quiet: bool, no_cuda_graphs: bool, no_compile: bool, graph_layers: int,
          no_prefetch: bool, read_ahead: bool, promote: bool, no_fused_mix: bool, presets: tuple[str, ...],
          speculate: str) -> None:
    """Time prefill and decode of PACK through the tiered store, against the machine's bandwidth roofline
    and (with --baseline) transformers + accelerate offload at the same budget. The store is always
    used: a budget left out gives its tier room for every record. --set changes any engine setting
    for an experiment (README: Configuration)."""
    from flashpack.runtime.bench import run_bench
    from flashpack.runtime.bench.presets import preset_settings
    from flashpack.runtime.bench.report import table

    config = _engine_config(
        device, dtype, vram_budget, ram_budget, policy, hot_set, no_direct_io, no_verify_records,
        (f"store.promote={promote}", *preset_settings(presets), *settings), speculate, experts="store",
        cuda_graphs=not no_cuda_graphs,
        compile_layers=not no_compile, prefetch=not no_prefetch, read_ahead=read_ahead, layers_per_graph=graph_layers,
        fused_mix=not no_fused_mix,
    )
    report = run_bench(
        pack, config, prompt_len=prompt_len, gen=gen, emulate_layers=emulate_layers, baseline=baseline,
        baseline_layers=baseline_layers, baseline_prompt_len=baseline_prompt_len, baseline_gen=baseline_gen,
        seed=seed, repeats=repeats, copy_probe=copy_probe, disk_probe=disk_probe, offload_dir=offload_dir,
        json_path=json_path, progress=not quiet,
    )
    click.echo(table(report))
    if json_path is not None:
        click.echo(f"wrote {json_path}")
    baseline_result = report["results"]["transformers"]
    if baseline_result is not None and "error" in baseline_result:
        click.echo(f"error: the {baseline} baseline failed: {baseline_result['error']}", err=True)
        sys.exit(1)


@main.command()
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("flashpack-demo"), show_default=True)
@click.option("--keep", is_flag=True, help="Keep the pack it converts.")
@one_line_errors
def demo(workdir: Path, keep: bool) -> None:
    """The main job on the embedded model (trained on code): convert, inspect, verify, run, serve."""
    from flashpack.demo import run_demo

    run_demo(workdir, keep=keep)


if __name__ == "__main__":
    main()
