"""The snapshot's tokenizer files: copied into the pack, then loaded once as `run` loads them.

A tokenizer that does not load, or a chat template that does not render, would otherwise show only
at the first `run` or `serve`, after an hour of converting; convert copies and checks them before
it writes anything else, and a failure is one line naming the file. Every file is first checked to
lie inside the snapshot (snapshot_paths), so a symlink leading out of it is refused, not packed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from flashpack.convert.snapshot_paths import snapshot_file
from flashpack.errors import FlashpackError

TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json",
)
# Where transformers finds the chat template, first place first.
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
_SAMPLE_CONVERSATION = [{"role": "user", "content": "Hello"}]


def copy_tokenizer(root: Path, pack: Path) -> list[str]:
    """Copy the snapshot's tokenizer files into `pack`/tokenizer; returns their pack paths."""
    copied = []
    (pack / TOKENIZER_DIR).mkdir()
    for name in TOKENIZER_FILES:
        if not (root / name).exists() and not (root / name).is_symlink():
            continue
        source = snapshot_file(root, name, "tokenizer file")
        if not source.is_file():
            raise FlashpackError(f"tokenizer file {name} in {root} is not a regular file")
        shutil.copyfile(source, pack / TOKENIZER_DIR / name)
        copied.append(f"{TOKENIZER_DIR}/{name}")
    if not copied:
        raise FlashpackError(f"{root} has no tokenizer files (tokenizer.json, tokenizer_config.json)")
    return copied


def check_tokenizer(pack: Path, root: Path) -> None:
    """Load the copied tokenizer with transformers, as `run` does, and render the chat template
    (when there is one) on a one-message conversation; FlashpackError naming the file otherwise."""
    from flashpack.runtime.tokenizer import PackTokenizer

    directory = pack / TOKENIZER_DIR
    for path in sorted(directory.glob("*.json")):
        try:
            document = json.loads(path.read_bytes())
        except ValueError as error:
            raise FlashpackError(f"tokenizer file {root / path.name} is not valid JSON: {error}") from None
        if not isinstance(document, dict):
            raise FlashpackError(f"tokenizer file {root / path.name} must be a JSON object")
    main_file = "tokenizer.json" if (directory / "tokenizer.json").is_file() else "tokenizer_config.json"
    try:
        tokenizer = PackTokenizer.load(pack)
    except FlashpackError:
        raise
    except Exception as error:  # transformers and tokenizers raise many types for a broken file
        raise FlashpackError(f"the tokenizer in {root} does not load ({main_file}): {_first_line(error)}") from None
    if not getattr(tokenizer.tokenizer, "chat_template", None):
        return
    template_file = next((name for name in _TEMPLATE_FILES if (directory / name).is_file()), "tokenizer_config.json")
    try:
        tokenizer.render_chat(_SAMPLE_CONVERSATION)
    except Exception as error:  # jinja2 raises its own types, templates raise what they like
        raise FlashpackError(f"the chat template in {root / template_file} does not render: {_first_line(error)}") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]
