"""bench/prompt_reuse.py's arithmetic by hand: the document built from repeated source, the layer
counts and state bytes it scales to the full model's layers, and a TTFT at that count."""

from __future__ import annotations

import pytest
import torch

from flashpack.bench.prompt_reuse import StateBytes, at_layers, document_text, layer_counts, state_parts, states_line
from flashpack.runtime.state import AttentionCache, DeltaNetState, PLEState, SequenceState


class _CharTokenizer:
    """A character a token: encode and decode are exact, so the cut is easy to check."""

    def __init__(self):
        self.tokenizer = self

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_document_repeats_the_source_to_the_token_count():
    assert document_text(_CharTokenizer(), "abc", 7) == "abcabca"
    assert document_text(_CharTokenizer(), "abcdef", 4) == "abcd"
    with pytest.raises(ValueError):
        document_text(_CharTokenizer(), "", 4)


def test_layer_counts_continue_the_attention_pattern():
    linear = [True, True, True, False] * 4  # the benchmark pack: 3 DeltaNet + 1 attention, four times
    ple = [True] + [False] * 15
    assert layer_counts(linear, ple, 48) == {"deltanet": (12, 36), "attention": (4, 12)}
    # no pattern to continue (attention twice in a row): each kind scaled evenly
    irregular = [True, False, False, True]
    assert layer_counts(irregular, [False] * 4, 8) == {"deltanet": (2, 4.0), "attention": (2, 4.0)}


def test_state_parts_split_the_bytes_by_what_they_scale_with():
    deltanet = DeltaNetState(torch.zeros(4, 3), torch.zeros(2, 2, 2))  # 48 + 32 bytes
    decoder, mtp = (AttentionCache(1, 2, 2, 4, torch.float32, "cpu", 8) for _ in range(2))
    ple = PLEState(torch.zeros(2, dtype=torch.int64), torch.zeros(3))  # 16 + 12 bytes
    state = SequenceState(0, {0: deltanet}, {1: decoder, 2: mtp}, {0: ple})  # layer 2: the MTP layer of 2 layers
    parts = state_parts(state, decoder_layers=2)
    assert parts == {"deltanet": 80, "attention": decoder.nbytes(), "other": 28 + mtp.nbytes()}
    assert sum(parts.values()) == state.nbytes()


def test_state_bytes_at_the_full_layer_count():
    at_1k = {"deltanet": 1200, "attention": 400 + 1000, "other": 50 + 10}
    at_2k = {"deltanet": 1200, "attention": 400 + 2000, "other": 50 + 20}
    sizes = StateBytes.from_states((1000, at_1k), (2000, at_2k))
    assert sizes.at(3000) == pytest.approx(1200 + 3400 + 80)
    counts = {"deltanet": (12, 36), "attention": (4, 12)}
    assert sizes.at(3000, counts) == pytest.approx(1200 * 3 + 3400 * 3 + 80)  # PLE and MTP parts stay


def test_ttft_at_layers_scales_state_moves_by_bytes_and_the_rest_by_layers():
    row = {"ttft_s": 1.0, "restore_s": 0.1, "saves_s": 0.15, "gc_s": 0.0}
    assert at_layers(row, layer_scale=3.0, bytes_scale=2.5) == pytest.approx(0.25 * 2.5 + 0.75 * 3.0)


def test_ttft_at_layers_keeps_collector_pauses_as_they_are():
    row = {"ttft_s": 1.0, "restore_s": 0.1, "saves_s": 0.15, "gc_s": 0.3}  # a walk of the heap, not the layers'
    assert at_layers(row, layer_scale=3.0, bytes_scale=2.5) == pytest.approx(0.25 * 2.5 + 0.3 + 0.45 * 3.0)


def test_ttft_at_layers_scales_only_the_layers_span_and_keeps_a_requests_own_work():
    """The part outside the layers' span (digests, lookup, embedding, head, sampling) is as it is;
    a span longer than what is left (a stored hit's waits counted in both) is capped there."""
    row = {"ttft_s": 1.0, "restore_s": 0.1, "saves_s": 0.15, "gc_s": 0.0, "layers_s": 0.6}
    assert at_layers(row, layer_scale=3.0, bytes_scale=2.5) == pytest.approx(0.25 * 2.5 + 0.15 + 0.6 * 3.0)
    capped = {**row, "layers_s": 0.9}
    assert at_layers(capped, layer_scale=3.0, bytes_scale=2.5) == pytest.approx(0.25 * 2.5 + 0.75 * 3.0)


class _ChatTokenizer(_CharTokenizer):
    """Characters, with a chat template of markers around each message and the assistant opening;
    `strip_replies`: a template that renders earlier replies otherwise than their text (stripped)."""

    def __init__(self, strip_replies: bool = False):
        super().__init__()
        self.strip_replies = strip_replies

    def encode_chat(self, messages: list[dict]) -> list[int]:
        def content(m):
            return m["content"].strip() if self.strip_replies and m["role"] == "assistant" else m["content"]
        return self.encode("".join(f"<{m['role']}>{content(m)}|" for m in messages) + "<assistant>")


def test_chat_ids_put_each_reply_back_as_its_generated_tokens():
    """Each reply's text is replaced by the tokens generated for it, every other token as the text
    encodes; without replies, the text's own encoding. A template that renders a reply otherwise
    than its text is refused (control: there the generated tokens have no place)."""
    from flashpack.bench.prompt_reuse import chat_ids

    tokenizer = _ChatTokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "yes"},
                {"role": "user", "content": "end"}]
    assert chat_ids(tokenizer, messages, None) == tokenizer.encode_chat(messages)
    replies = {1: [900, 901, 902], 3: [903]}  # non-canonical: other tokens, other counts
    encode = tokenizer.encode
    assert chat_ids(tokenizer, messages, replies) == (
        encode("<user>hi|<assistant>") + [900, 901, 902] + encode("|<user>more|<assistant>") + [903]
        + encode("|<user>end|<assistant>"))
    spaced = [*messages[:3], {"role": "assistant", "content": " yes"}, messages[4]]
    with pytest.raises(ValueError, match="not rendered"):
        chat_ids(_ChatTokenizer(strip_replies=True), spaced, {3: [903]})


def test_store_counts_are_the_store_totals_over_its_layers():
    """What a request's row subtracts: the totals over every layer, and the store's wait; none
    without a store."""
    from types import SimpleNamespace

    from flashpack.bench.prompt_reuse import _moved, store_counts
    from flashpack.runtime.store.stats import StoreStats

    assert store_counts(SimpleNamespace(store=None)) is None
    stats = StoreStats()
    stats.bump(0, requests=10, device_hits=4, host_hits=5, disk_reads=1, bytes_host_to_device=6_000_000_000)
    stats.bump(3, requests=2, disk_reads=2, bytes_disk_to_host=500)
    stats.add_time("wait_seconds", 0.25)
    counted = store_counts(SimpleNamespace(store=SimpleNamespace(stats=stats)))
    assert counted == {"requests": 12, "device_hits": 4, "host_hits": 5, "disk_reads": 3,
                       "bytes_host_to_device": 6_000_000_000, "bytes_disk_to_host": 500, "prefetch_issued": 0,
                       "prefetch_from_disk": 0, "wait_s": 0.25}
    assert _moved(counted) == "6.00 (3)"
    assert _moved(None) == "-"


def _short_prompt_engine(limit: int, compiled: bool, recurrent: int, kernel: bool):
    """An engine's step and model as short_prompt_paths_aside sees them: a step's chunk limit, two
    modules holding compile_pieces (one of them recurrent_max_tokens too), a norm holding
    use_kernel, one module holding none."""
    from types import SimpleNamespace

    from torch import nn

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.ReLU(), nn.Identity())
    model[0].compile_pieces = compiled
    model[1].compile_pieces, model[1].recurrent_max_tokens = compiled, recurrent
    model[3].use_kernel = kernel
    model.device = torch.device("cpu")
    return SimpleNamespace(step=SimpleNamespace(prompt_graphs_max_tokens=limit, model=model))


def test_short_prompt_paths_aside_sets_every_setting_to_its_default_and_back():
    """--ab-rounds' other arm: the step's chunk limit 0, compiled pieces off, the recurrence for one
    token only and the norms' plain code inside; the engine's own after, an error too."""
    from flashpack.bench.prompt_reuse import short_prompt_paths_aside, short_prompt_settings
    from flashpack.runtime.engine.config import EngineConfig

    engine = _short_prompt_engine(128, True, 16, True)
    as_set = {"prompt_graphs_max_tokens": 128, "compile_prompt_pieces": True, "delta_rule_recurrent_max_tokens": 16,
              "fused_norms": True}
    defaults = {**{name: getattr(EngineConfig, name) for name in as_set}, "delta_rule_recurrent_max_tokens": 1}  # a CPU's
    assert short_prompt_settings(engine) == as_set
    with short_prompt_paths_aside(engine):
        assert short_prompt_settings(engine) == defaults
        assert engine.step.model[0].compile_pieces is False  # every module, not only one
    assert short_prompt_settings(engine) == as_set and engine.step.model[0].compile_pieces is True
    with pytest.raises(RuntimeError), short_prompt_paths_aside(engine):
        raise RuntimeError
    assert short_prompt_settings(engine) == as_set
    assert short_prompt_settings(_short_prompt_engine(0, False, 1, False)) == defaults


def test_short_prompt_paths_aside_sets_only_the_named_settings_aside():
    """--ab-aside's series: only the named settings go to their defaults; the others stay as set."""
    from flashpack.bench.prompt_reuse import short_prompt_paths_aside, short_prompt_settings

    engine = _short_prompt_engine(128, True, 16, True)
    as_set = short_prompt_settings(engine)
    with short_prompt_paths_aside(engine, ("delta_rule_recurrent_max_tokens",)):
        assert short_prompt_settings(engine) == {**as_set, "delta_rule_recurrent_max_tokens": 1}
    with short_prompt_paths_aside(engine, ("compile_prompt_pieces", "fused_norms")):
        assert short_prompt_settings(engine) == {**as_set, "compile_prompt_pieces": False, "fused_norms": False}
    assert short_prompt_settings(engine) == as_set


def test_ab_aside_takes_only_short_prompt_settings():
    import argparse

    from flashpack.bench.prompt_reuse import parse_aside

    assert parse_aside("fused_norms,compile_prompt_pieces") == ("fused_norms", "compile_prompt_pieces")
    for bad in ("", "fused_norm", "fused_norms,prefetch"):
        with pytest.raises(argparse.ArgumentTypeError, match="--ab-aside takes"):
            parse_aside(bad)


def test_ab_summary_counts_each_pair_once_and_takes_each_arms_median():
    """Three ABBA pairs: the as-set arm's median 1.0 against 2.0, ahead in two of three pairs."""
    from flashpack.bench.prompt_reuse import ab_summary

    times = {(1, True): 1.0, (1, False): 2.0, (2, False): 1.5, (2, True): 0.5, (3, True): 3.0, (3, False): 2.5}
    rows = [{"round": number, "as_set": as_set, "ttft_s": seconds} for (number, as_set), seconds in times.items()]
    assert ab_summary(rows) == ("Median TTFT: as set 1.000 s, aside 2.000 s (as set / aside 0.50); "
                                "as set ahead in 2 of 3 pairs.")


def test_round_questions_encode_to_as_many_tokens():
    """--ab-rounds' hits prefill as many tokens each: every question the rounds may ask encodes
    to one count with the demo model's tokenizer (digits a token each, as Qwen's); none past them."""
    import transformers

    from flashpack import demo_model
    from flashpack.bench.prompt_reuse import MAX_AB_ROUNDS, round_question

    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_model.snapshot_path())
    counts = {len(tokenizer.encode(round_question(index))) for index in range(2 * MAX_AB_ROUNDS)}
    assert len(counts) == 1
    assert len(tokenizer.encode("Question 100: ")) != len(tokenizer.encode("Question 99: "))  # control: a third digit
    with pytest.raises(ValueError, match="two digits"):
        round_question(2 * MAX_AB_ROUNDS)


def test_the_states_line_says_how_many_saves_stayed_and_where_the_hits_came_from():
    live = {"saved": 12, "evicted": 12, "live_entries": 0, "live_bytes": 0, "hits": 2, "stored_hits": 2,
            "stored": {"writes": 2, "skipped_writes": 0}}
    line = states_line(live)
    assert "12 saved, 12 evicted or dropped, 0 live at the end" in line
    assert "2 hits, 2 of them read from the disk" in line and "2 written, 0 skipped" in line
    assert states_line(None) == "The live engine's prompt states: not reported."
