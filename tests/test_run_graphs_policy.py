"""`flashpack run --cuda-graphs auto|on|off`: a short one-shot run decodes eagerly, a long one from graphs."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from flashpack.cli import main
from flashpack.runtime.engine import build
from flashpack.runtime.engine.config import EngineConfig


def _pays_from(layers: int) -> int:
    return -(-EngineConfig.graphs_min_layer_tokens // layers)


def test_graphs_pay_from_fewer_tokens_the_more_layers_a_token_crosses():
    assert _pays_from(48) == 43 and _pays_from(8) == 256
    assert build.decode_graphs_pay(43, 48) and not build.decode_graphs_pay(42, 48)
    assert build.decode_graphs_pay(42, 48, min_layer_tokens=42 * 48)


@pytest.mark.parametrize(("flags", "expected"), [
    (["--max-tokens", "8"], False),
    (["--max-tokens", str(_pays_from(8))], True),  # the tiny pack has 8 layers
    (["--max-tokens", str(_pays_from(8) - 1)], False),
    (["--max-tokens", "8", "--cuda-graphs", "on"], True),
    (["--max-tokens", "4096", "--cuda-graphs", "off"], False),
    (["--max-tokens", "8", "--set", "graphs_min_layer_tokens=64"], True),
])
def test_run_asks_for_graphs_only_where_they_pay(tiny_pack, monkeypatch, flags, expected):
    seen = {}
    real = build.load_engine

    def recording(pack, config, decode_tokens=None, **kwargs):
        engine = real(pack, config, decode_tokens=decode_tokens, **kwargs)
        layers = engine.model_config.num_hidden_layers
        seen["cuda_graphs"] = config.cuda_graphs and (decode_tokens is None or build.decode_graphs_pay(
            decode_tokens, layers, config.graphs_min_layer_tokens))
        raise click.exceptions.Exit(0)  # what was asked for is all this test needs: no generation on a CPU

    monkeypatch.setattr(build, "load_engine", recording)
    result = CliRunner().invoke(main, ["run", str(tiny_pack), "hello", *flags])
    assert result.exit_code == 0, result.output
    assert seen["cuda_graphs"] is expected
