"""The trainer's tests reuse the engine tests' helpers (tests/runtime/reference_model.py): random
perturbation of a transformers model and in-memory engine weight sources."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "runtime"))
