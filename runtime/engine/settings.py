"""`KEY=VALUE` settings onto an EngineConfig: what `--set` takes (`flashpack bench`, `run`, `serve`).

    with_settings(EngineConfig(), ["staged_beside_experts=0", "store.read_pieces=1"])

A key is an EngineConfig field, or `store.` and a StoreConfig field. A value is read as the
field's type: true/false (also on/off, yes/no, 1/0) for a switch, a whole number, a word, or
`none` where a field may be unset. The configs validate the result, so an unknown key, a value of
the wrong type and a value out of range are each refused with one line naming them.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable

from flashpack.errors import FlashpackError
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.store.config import StoreConfig

_TRUE, _FALSE = {"true", "on", "yes", "1"}, {"false", "off", "no", "0"}


def setting_keys() -> dict[str, object]:
    """Every key `--set` takes, with its default."""
    keys = {f.name: getattr(EngineConfig(), f.name) for f in dataclasses.fields(EngineConfig) if f.name != "store"}
    keys.update({f"store.{f.name}": getattr(StoreConfig(), f.name) for f in dataclasses.fields(StoreConfig)})
    return keys


def with_settings(config: EngineConfig, assignments: Iterable[str]) -> EngineConfig:
    engine: dict[str, object] = {}
    store: dict[str, object] = {}
    for assignment in assignments:
        key, equals, text = assignment.partition("=")
        key = key.strip()
        if not equals or not key:
            raise FlashpackError(f"--set takes KEY=VALUE, got {assignment!r}")
        owner, name, into = (StoreConfig, key[len("store."):], store) if key.startswith("store.") else (EngineConfig, key, engine)
        if name not in {f.name for f in dataclasses.fields(owner)} - {"store"}:
            raise FlashpackError(f"unknown setting {key!r}: the keys are {', '.join(setting_keys())}")
        into[name] = _parse(key, text.strip(), typing.get_type_hints(owner)[name])
    if store:
        engine["store"] = dataclasses.replace(config.store, **store)
    return dataclasses.replace(config, **engine)


def _parse(key: str, text: str, annotation) -> object:
    choices = typing.get_args(annotation) or (annotation,)
    if type(None) in choices and text.lower() == "none":
        return None
    if bool in choices:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise FlashpackError(f"setting {key} takes true or false, got {text!r}")
    if int in choices:
        try:
            return int(text)
        except ValueError:
            if str not in choices:
                raise FlashpackError(f"setting {key} takes a whole number, got {text!r}") from None
    return text
