"""lm-eval's `local-completions` against a running `flashpack serve`, on our tasks, and what the
code task's score means beside the demo model's recorded held-out loss.

lm-eval sends the pack's own token ids (the pack's tokenizer, `tokenized_requests`), one prompt at a
time unless `batch_size` says more; each document of the code task is scored after the model's
end-of-text id (`custom_prefix_token_id`: the token the training stream put before every file). The
record's held-out loss is in nats per token over its 1,024-token windows; in bits per byte it is
loss / ln 2 / (bytes per token), the unit of lm-eval's `bits_per_byte`.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from flashpack.errors import FlashpackError
from flashpack.evals import TASK_NAMES, TASKS_DIR


def model_args(base_url: str, pack: Path, model: str, batch_size: int = 1, api_key: str | None = None) -> dict[str, Any]:
    """local-completions' arguments for the server at `base_url` serving `pack` as `model`."""
    manifest = json.loads((pack / "manifest.json").read_text())
    args = {"base_url": f"{base_url.rstrip('/')}/v1/completions", "model": model, "tokenizer_backend": "huggingface",
            "tokenizer": str(pack / "tokenizer"), "tokenized_requests": True, "num_concurrent": 1,
            "max_retries": 1, "batch_size": batch_size,
            "custom_prefix_token_id": int(manifest["model"]["text_config"]["eos_token_id"])}
    if api_key:
        args["header"] = {"Authorization": f"Bearer {api_key}"}
    return args


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The id the server serves (GET /v1/models), or one line saying why it cannot be had."""
    request = urllib.request.Request(f"{base_url.rstrip('/')}/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())["data"][0]["id"]
    except urllib.error.HTTPError as error:
        raise FlashpackError(f"{base_url} answered {error.code} to GET /v1/models (an API key missing?)") from None
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as error:
        raise FlashpackError(f"no flashpack server answers at {base_url}: {error}") from None


def evaluate(base_url: str, pack: Path, tasks: tuple[str, ...] = TASK_NAMES, limit: int | None = None,
             max_files: int | None = None, batch_size: int = 1, api_key: str | None = None) -> dict[str, Any]:
    """lm-eval's results dictionary (`results[task][metric + ",none"]`)."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise FlashpackError("lm-eval is not installed: pip install -e '.[eval]'") from None
    if not (pack / "manifest.json").is_file():
        raise FlashpackError(f"{pack} is not a pack (no manifest.json)")
    args = model_args(base_url, pack, served_model(base_url, api_key), batch_size, api_key)
    metadata = {"max_files": max_files} if max_files is not None else None
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=metadata)
    return lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=list(tasks), limit=limit,
                                   task_manager=manager, log_samples=False)


def held_out_in_bits_per_byte(record: dict[str, Any]) -> float:
    """The training record's held-out loss (nats per token) in bits per byte of the same files."""
    return record["final"]["loss"] / math.log(2) / record["tokens"]["bytes_per_token_held_out"]
