"""Fixtures for the eval tests: the trained demo model's engine (its pack: tests/conftest.py), and the server harness."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "server"))  # server_harness


@pytest.fixture(scope="session")
def demo_engine(demo_pack):
    from flashpack.runtime.engine.build import load_engine
    from flashpack.runtime.engine.config import EngineConfig
    from flashpack.runtime.store.config import StoreConfig

    return load_engine(demo_pack, EngineConfig(store=StoreConfig(verify_records=False)))
