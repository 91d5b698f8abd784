"""The pack manifest: typed views of manifest.json, loaded and checked against its JSON schema.

The manifest is the whole truth about a pack (FORMAT.md): which files exist, where each tensor,
expert record and PLE table sits, and what the model is. Readers go through `Manifest.load`, which
refuses another format version or anything the schema rejects, with one line saying why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from flashpack.errors import FlashpackError
from flashpack.layout.model_config import TextConfig
from flashpack.layout.records import RecordGeometry

FORMAT_NAME = "flashpack"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"


def manifest_schema() -> dict[str, Any]:
    text = resources.files("flashpack.manifests").joinpath(f"pack-v{FORMAT_VERSION}.schema.json").read_text()
    return json.loads(text)


def validate_manifest(document: dict[str, Any]) -> None:
    """Raise FlashpackError naming the first schema violation."""
    version = document.get("format_version")
    if document.get("format") != FORMAT_NAME:
        raise FlashpackError(f"not a flashpack manifest (format {document.get('format')!r})")
    if version != FORMAT_VERSION:
        raise FlashpackError(
            f"pack format version {version} is not supported by this flashpack (reads version {FORMAT_VERSION}); "
            "re-run `flashpack convert`"
        )
    try:
        jsonschema.validate(document, manifest_schema())
    except jsonschema.ValidationError as error:
        where = "/".join(str(part) for part in error.absolute_path) or "(root)"
        raise FlashpackError(f"manifest invalid at {where}: {error.message}") from None


@dataclass(frozen=True)
class ExpertRecordEntry:
    layer: int
    expert: int
    file: str
    offset: int
    length: int
    xxh64: str


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    row_scale: str | None = None  # name of the float32 [rows] scale of an FP8 matrix


@dataclass(frozen=True)
class PleTable:
    layer: int
    ple_index: int
    file: str
    rows: int
    dim: int
    row_stride: int
    head_vocab_sizes: tuple[int, ...]
    head_offsets: tuple[int, ...]
    multipliers: tuple[int, ...]


@dataclass(frozen=True)
class Manifest:
    document: dict[str, Any]

    @classmethod
    def load(cls, pack: Path) -> "Manifest":
        path = pack / MANIFEST_FILE
        if not path.is_file():
            raise FlashpackError(f"{pack} is not a flashpack pack: {MANIFEST_FILE} is missing")
        try:
            document = json.loads(path.read_text())
        except ValueError as error:
            raise FlashpackError(f"{path} is not valid JSON: {error}") from None
        validate_manifest(document)
        return cls(document)

    @property
    def config(self) -> TextConfig:
        return TextConfig.from_text_dict(self.document["model"]["text_config"])

    @property
    def geometry(self) -> RecordGeometry:
        experts = self.document["experts"]
        return RecordGeometry(experts["hidden_size"], experts["intermediate_size"])

    def expert_records(self) -> list[ExpertRecordEntry]:
        return [ExpertRecordEntry(**entry) for entry in self.document["experts"]["records"]]

    def dense_tensors(self) -> dict[str, TensorEntry]:
        return _tensor_entries(self.document["dense"]["tensors"])

    def vision_tensors(self) -> dict[str, TensorEntry]:
        vision = self.document.get("vision")
        return _tensor_entries(vision["tensors"]) if vision else {}

    def ple_tables(self) -> list[PleTable]:
        return [
            PleTable(**{**entry, **{k: tuple(entry[k]) for k in ("head_vocab_sizes", "head_offsets", "multipliers")}})
            for entry in self.document["ple"]
        ]

    def files(self) -> list[dict[str, Any]]:
        return self.document["files"]

    @property
    def hot_sets(self) -> dict[str, Any]:
        return self.document["hot_sets"]


def _tensor_entries(entries: list[dict[str, Any]]) -> dict[str, TensorEntry]:
    return {e["name"]: TensorEntry(**{**e, "shape": tuple(e["shape"])}) for e in entries}


def write_manifest(pack: Path, document: dict[str, Any]) -> None:
    """Validate, then write atomically: a manifest on disk is always a whole, valid one."""
    validate_manifest(document)
    temporary = pack / (MANIFEST_FILE + ".tmp")
    temporary.write_text(json.dumps(document, indent=1))
    temporary.replace(pack / MANIFEST_FILE)
