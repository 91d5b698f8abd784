"""`flashpack serve`: every option is checked before the model loads; the settings it builds."""

from __future__ import annotations

import socket

import pytest
import uvicorn
from click.testing import CliRunner

import flashpack.runtime.engine.build
from flashpack.cli import main


@pytest.fixture
def no_load(monkeypatch):
    """load_engine fails the test if serve gets that far."""

    def load_engine(*args, **kwargs):
        raise AssertionError("serve loaded the model before checking its options")

    monkeypatch.setattr(flashpack.runtime.engine.build, "load_engine", load_engine)


@pytest.mark.parametrize("options, message", [
    (["--port", "70000"], "'--port': 70000 is not in the range 1<=x<=65535"),
    (["--port", "0"], "'--port': 0 is not in the range"),
    (["--host", "no-such-host.invalid"], "cannot serve on no-such-host.invalid:8000"),
    (["--vram-budget", "12 parsecs"], "cannot read --vram-budget '12 parsecs'"),
    (["--api-key", "   "], "the API key must not be blank"),
    (["--max-queue", "-1"], "'--max-queue': -1 is not in the range x>=0"),
    (["--max-connections", "0"], "'--max-connections': 0 is not in the range x>=1"),
    (["--header-timeout", "0"], "'--header-timeout': 0.0 is not in the range x>0"),
    (["--max-request-bytes", "10"], "'--max-request-bytes': 10 is not in the range x>=1024"),
    (["--model-name", " "], "the served model name must not be empty"),
    (["--log-level", "loud"], "'--log-level': 'loud' is not one of"),
])
def test_a_bad_option_is_one_line_and_exit_2_before_the_model_loads(no_load, tiny_pack, options, message):
    result = CliRunner().invoke(main, ["serve", str(tiny_pack), *options])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output


def test_a_port_in_use_is_refused_before_loading(no_load, tiny_pack):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", str(tiny_pack), "--port", str(port)])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: cannot serve on 127.0.0.1:{port}: Address already in use"


def test_a_folder_that_is_no_pack_is_refused_before_loading(no_load, tmp_path):
    result = CliRunner().invoke(main, ["serve", str(tmp_path)])
    assert result.exit_code == 2 and result.output.strip() == f"error: {tmp_path} is not a flashpack pack: " \
                                                               "manifest.json is missing"


def test_serve_builds_settings_then_loads_then_runs(monkeypatch, tiny_pack, tiny_tokenizer):
    from server_fakes import fake_engine

    order, ran = [], {}

    def load_engine(pack, config, **kwargs):
        order.append("load")
        return fake_engine(tiny_tokenizer)

    def run(server):
        order.append("run")
        ran.update(config=server.config)

    monkeypatch.setattr(flashpack.runtime.engine.build, "load_engine", load_engine)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setenv("FLASHPACK_API_KEY", "from-env")
    result = CliRunner().invoke(main, ["serve", str(tiny_pack), "--max-queue", "3", "--header-timeout", "2.5",
                                       "--max-connections", "40", "--keep-alive-timeout", "1"])
    assert result.exit_code == 0, result.output
    config = ran["config"]
    settings = config.app.state.flashpack.settings
    assert order == ["load", "run"]
    assert (config.host, config.port, config.timeout_keep_alive) == ("127.0.0.1", 8000, 1.0)
    assert (settings.api_key, settings.model_name, settings.max_queue) == ("from-env", "tiny-bf16", 3)
    limits = config.http.keywords["limits"]
    assert (limits.max_connections, limits.header_timeout) == (40, 2.5)


@pytest.mark.parametrize("source, text_config, expected", [
    ({"repo_id": "Qwen/Qwen3.8-Flash-Next", "path": "/cache/models--Qwen--Other/snapshots/ab12"},
     {"_name_or_path": "ignored"}, "Qwen/Qwen3.8-Flash-Next"),
    ({"repo_id": None, "path": "/anywhere/snap"}, {"_name_or_path": "Org/From-Config"}, "Org/From-Config"),
    ({"repo_id": None, "path": "/anywhere/snap"}, {"name_or_path": "/models/local-model/"}, "local-model"),
    ({"repo_id": None, "path": "/root/.cache/huggingface/hub/models--Qwen--Qwen3.8-Flash-Next/snapshots/0123abcd"},
     {}, "Qwen/Qwen3.8-Flash-Next"),
    ({"repo_id": None, "path": "/data/models--gpt2/snapshots/0123abcd"}, {}, "gpt2"),
    ({"repo_id": None, "path": "/data/tiny-bf16"}, {}, "tiny-bf16"),
    ({}, {}, "served-model"),
])
def test_the_default_model_id_is_the_models_name(source, text_config, expected):
    from flashpack.runtime.server.model_name import model_name_from_manifest

    document = {"source": source, "model": {"text_config": text_config}}
    assert model_name_from_manifest(document, "/packs/served-model.pack/") == expected


def test_the_default_model_id_of_a_real_pack_is_its_source_folder(tiny_pack):
    from flashpack.runtime.server.model_name import pack_model_name

    assert tiny_pack.name == "tiny.pack" and pack_model_name(tiny_pack) == "tiny-bf16"
