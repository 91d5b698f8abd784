"""lm-eval tasks of our own, on the demo model's held-out code, run against `flashpack serve`
(evals/README.md): `TASKS_DIR` is the folder to hand lm-eval as its include path."""

from pathlib import Path

TASKS_DIR = Path(__file__).parent / "tasks"
TASK_NAMES = ("flashpack_heldout_code", "flashpack_next_line")
