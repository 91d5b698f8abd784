"""Sampling, incremental detokenisation and stop strings against plain definitions."""

import pytest
import torch

from flashpack.errors import FlashpackError
from flashpack.runtime.detokenize import IncrementalDetokenizer, StopStringFilter
from flashpack.runtime.sampling import Sampler, SamplingParams, filtered_probabilities


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert Sampler(SamplingParams())(logits) == 1


def test_seeded_sampling_repeats_and_differs_across_seeds():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))

    def draws(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler(logits) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sampling on the GPU")
def test_sampling_on_the_gpu_repeats_and_keeps_to_the_cut():
    """The Generator samples where the logits are: seeded runs repeat there too, and a top-k cut
    holds (the 5 largest of 248k logits)."""
    logits = torch.randn(248_320, generator=torch.Generator().manual_seed(1)).cuda()
    allowed = set(torch.topk(logits, 5).indices.tolist())

    def draws(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=seed), device="cuda")
        return [sampler(logits) for _ in range(20)]

    assert draws(3) == draws(3) and set(draws(3)) <= allowed
    assert Sampler(SamplingParams(), device="cuda")(logits) == int(logits.argmax())


def test_top_k_and_top_p_keep_exactly_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.10]))
    probs = filtered_probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(probs, torch.tensor([2 / 3, 1 / 3, 0, 0]))
    probs = filtered_probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(probs, torch.tensor([2 / 3, 1 / 3, 0, 0]))
    probs = filtered_probabilities(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(probs, torch.tensor([2 / 3, 1 / 3, 0, 0]))  # 0.75 reached exactly by two tokens
    probs = filtered_probabilities(logits, SamplingParams(temperature=1.0, top_p=0.76))
    assert (probs > 0).sum() == 3


def test_sampling_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    counts = torch.bincount(torch.tensor([sampler(logits) for _ in range(4000)]), minlength=3).float() / 4000
    assert torch.allclose(counts, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)


@pytest.mark.parametrize(
    "kwargs", [{"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}]
)
def test_invalid_sampling_values_are_refused(kwargs):
    with pytest.raises(FlashpackError):
        SamplingParams(**kwargs)


class _ByteTokenizer:
    """Each id is one UTF-8 byte: multi-byte characters span several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_detokenisation_equals_full_decode():
    text = "naïve café — 東京 ok"
    ids = list(text.encode())
    detok = IncrementalDetokenizer(_ByteTokenizer())
    streamed = "".join(detok.push(i) for i in ids)
    assert streamed == text


def test_stop_string_across_chunks_is_cut_and_held_back():
    stop = StopStringFilter(("</end>",))
    pieces = ["hello </", "en", "d> never"]
    out = [stop.push(p) for p in pieces]
    assert out == ["hello ", "", ""] and stop.stopped
    keep = StopStringFilter(("</end>",))
    assert keep.push("a </e") == "a " and keep.push("x") == "</ex" and keep.flush() == ""
