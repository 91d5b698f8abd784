"""Fixtures for the server tests: the tiny pack's engine and tokenizer, one torch thread."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # server_harness, server_fakes


@pytest.fixture(scope="session")
def tiny_engine(tiny_pack):
    from flashpack.runtime.engine.build import load_engine
    from flashpack.runtime.engine.config import EngineConfig
    from flashpack.runtime.store.config import StoreConfig

    return load_engine(tiny_pack, EngineConfig(store=StoreConfig(verify_records=False)))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_pack):
    from flashpack.runtime.tokenizer import PackTokenizer

    return PackTokenizer.load(tiny_pack)

