"""flashpack's embedded demo model: a small qwen4_exp trained on Python code (TRAINING.md says how).

The package ships the snapshot (snapshot/, the real checkpoint's layout, BF16) and the record of
the run that trained it (training-record.json); `flashpack convert` takes the snapshot like any
other.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from flashpack.errors import FlashpackError


def snapshot_path() -> Path:
    """The demo model's Hugging Face snapshot folder inside the installed package."""
    path = _folder() / "snapshot"
    if not (path / "config.json").is_file():
        raise FlashpackError(f"the demo model's snapshot is missing from this install (looked in {path})")
    return path


def training_record() -> dict[str, Any]:
    """The training run's record: seed, corpus, dims, steps, tokens, wall time, loss curve, held-out numbers."""
    path = _folder() / "training-record.json"
    if not path.is_file():
        raise FlashpackError(f"the demo model's training record is missing from this install (looked in {path})")
    return json.loads(path.read_text())


def _folder() -> Path:
    return Path(str(resources.files(__name__)))
