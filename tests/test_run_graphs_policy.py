"""`flashpack run --cuda-graphs auto|on|off`: a short one-shot run decodes eagerly, a long one from graphs."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from flashpack.cli import main
from flashpack.runtime import loader


@pytest.mark.parametrize(("flags", "expected"), [
    (["--max-tokens", "8"], False),
    (["--max-tokens", str(loader.GRAPHS_MIN_TOKENS)], True),
    (["--max-tokens", "8", "--cuda-graphs", "on"], True),
    (["--max-tokens", "4096", "--cuda-graphs", "off"], False),
])
def test_run_asks_for_graphs_only_where_they_pay(tiny_pack, monkeypatch, flags, expected):
    seen = {}
    real = loader.load_engine

    def recording(*args, **kwargs):
        seen["cuda_graphs"] = kwargs["cuda_graphs"]
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "load_engine", recording)
    result = CliRunner().invoke(main, ["run", str(tiny_pack), "hello", *flags])
    assert result.exit_code == 0, result.output
    assert seen["cuda_graphs"] is expected
