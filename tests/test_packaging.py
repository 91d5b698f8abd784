"""A wheel holds every package: pyproject's explicit `packages` list names each folder of the tree
that has an __init__.py (bench/ and tests/ are not installed)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"flashpack"} | {
        "flashpack." + ".".join(init.parent.relative_to(ROOT).parts)
        for init in ROOT.rglob("__init__.py")
        if init.parent != ROOT and init.relative_to(ROOT).parts[0] not in {"tests", "bench", ".venv", ".before"}
        and not any(part.startswith(".") for part in init.relative_to(ROOT).parts)
    }
    assert found == listed, (sorted(found - listed), sorted(listed - found))
