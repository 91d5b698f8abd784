"""Checks on a parsed JSON body that no field type can express: valid Unicode, bounded nesting.

JSON may carry a lone surrogate (`"\\ud800"`, or the raw bytes ed a0 80, which Python's JSON reader
decodes to the same), which is no character: it cannot be encoded as UTF-8, so it would fail deep
inside the tokenizer or when an error message quoting it is written out. Deep nesting would exhaust
Python's recursion in the schema and template code after validation. Both are refused up front, by
a request model's `model_validator(mode="before")`, naming the field.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic_core import PydanticCustomError

MAX_DEPTH = 100  # JSON schemas nest two levels per object level: 50 object levels
_SURROGATE = re.compile("[\ud800-\udfff]")


def checked_body(data: Any) -> Any:
    """check_body for a pydantic `model_validator(mode="before")`: the reason as the error's message."""
    try:
        return check_body(data)
    except ValueError as error:
        raise PydanticCustomError("invalid_body", "{reason}", {"reason": str(error)}) from None


def check_body(data: Any) -> Any:
    """Raise ValueError naming the first field that holds a lone surrogate or nests past MAX_DEPTH."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise ValueError(f"{_where(path[:MAX_DEPTH])}: nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str):
                    _check_text(key, path + (key,), is_key=True)
                stack.append((item, path + (str(key),)))
        elif isinstance(value, list):
            stack.extend((item, path + (str(index),)) for index, item in enumerate(value))
    return data


def _check_text(text: str, path: tuple[str, ...], is_key: bool = False) -> None:
    found = _SURROGATE.search(text)
    if found is not None:
        what = "a key" if is_key else "text"
        raise ValueError(f"{_where(path)}: {what} holding a lone surrogate (U+{ord(found.group()):04X} at "
                         f"character {found.start()}) is not valid Unicode")


def _where(path: tuple[str, ...]) -> str:
    """The field's path, printable even where a key is itself the bad text."""
    return ".".join(_SURROGATE.sub("?", part) for part in path) or "body"
