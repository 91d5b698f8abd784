"""The pack manifest: typed views of manifest.json, loaded and checked against its JSON schema.

The manifest is the whole truth about a pack (FORMAT.md): which files exist and their hashes,
where each tensor, expert record and PLE table sits, and what the model is. Readers go through
`Manifest.load`, which refuses another format version (FlashpackError), or a document the schema
rejects or whose `manifest_xxh64` does not match its content (PackDamageError), with one line
saying why. Every writer goes through `write_manifest`, which re-hashes the files it rewrote and
stamps the manifest's own hash.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from flashpack.errors import FlashpackError, PackDamageError
from flashpack.layout.checksums import MANIFEST_HASH_KEY, file_entries, manifest_digest, stamp_manifest
from flashpack.layout.model_config import TextConfig
from flashpack.layout.records import RecordGeometry

FORMAT_NAME = "flashpack"
FORMAT_VERSION = 2
MANIFEST_FILE = "manifest.json"


def manifest_schema() -> dict[str, Any]:
    text = resources.files("flashpack.manifests").joinpath(f"pack-v{FORMAT_VERSION}.schema.json").read_text()
    return json.loads(text)


def validate_manifest(document: dict[str, Any]) -> None:
    """Refuse another format or version (FlashpackError: the user re-converts) and anything the
    schema rejects (PackDamageError naming the first violation)."""
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        found = document.get("format") if isinstance(document, dict) else None
        raise FlashpackError(f"not a flashpack manifest (format {found!r})")
    version = document.get("format_version")
    if version != FORMAT_VERSION:
        raise FlashpackError(
            f"pack format version {version} is not supported by this flashpack (reads version {FORMAT_VERSION}); "
            "re-run `flashpack convert`"
        )
    validator = _schema_validator()
    if not validator.is_valid(document):  # the fast path: finding the best error walks the document again
        error = jsonschema.exceptions.best_match(validator.iter_errors(document))
        where = "/".join(str(part) for part in error.absolute_path) or "(root)"
        raise PackDamageError(f"manifest invalid at {where}: {error.message}")


@functools.cache
def _schema_validator() -> jsonschema.Draft202012Validator:
    """Built once a process: the schema itself needs checking only once."""
    schema = manifest_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def manifest_hash_problem(document: dict[str, Any]) -> str | None:
    """None when `manifest_xxh64` matches the document's canonical content, else one line."""
    actual = manifest_digest(document)
    if document.get(MANIFEST_HASH_KEY) == actual:
        return None
    return (f"pack damaged: {MANIFEST_FILE} fails its xxh64 check (its content hashes to {actual}, "
            f"{MANIFEST_HASH_KEY} says {document.get(MANIFEST_HASH_KEY)}): it was changed after it was written")


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
    def read(cls, pack: Path) -> "Manifest":
        """Parse and schema-check manifest.json without checking its own hash (`inspect --check`
        reports that mismatch beside everything else)."""
        path = pack / MANIFEST_FILE
        if not path.is_file():
            raise FlashpackError(f"{pack} is not a flashpack pack: {MANIFEST_FILE} is missing")
        try:
            document = json.loads(path.read_bytes())
        except ValueError as error:
            raise PackDamageError(f"pack damaged: {path} is not valid JSON: {error}") from None
        validate_manifest(document)
        return cls(document)

    @classmethod
    def load(cls, pack: Path) -> "Manifest":
        manifest = cls.read(pack)
        problem = manifest_hash_problem(manifest.document)
        if problem is not None:
            raise PackDamageError(problem)
        return manifest

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
        """The `files` entries: {path, bytes, role, xxh64} and, for block-hashed files, block_bytes and blocks."""
        return self.document["files"]

    def file_entry(self, path: str) -> dict[str, Any] | None:
        return next((entry for entry in self.document["files"] if entry["path"] == path), None)

    @property
    def hot_sets(self) -> dict[str, Any]:
        return self.document["hot_sets"]


def _tensor_entries(entries: list[dict[str, Any]]) -> dict[str, TensorEntry]:
    return {e["name"]: TensorEntry(**{**e, "shape": tuple(e["shape"])}) for e in entries}


def write_manifest(pack: Path, document: dict[str, Any], rewritten: Iterable[str] = ()) -> None:
    """The one way a manifest is written: re-hash the files named in `rewritten` (paths relative
    to `pack`; a block-hashed file's digest file is rewritten with it), stamp `manifest_xxh64`,
    validate, then write atomically, so a manifest on disk is always a whole, valid one that
    agrees with its files."""
    for path in rewritten:
        index = next((i for i, entry in enumerate(document["files"]) if entry["path"] == path), None)
        if index is None:
            raise ValueError(f"{path} is not among the manifest's files")
        old = document["files"][index]
        fresh = file_entries(pack, path, old["role"], old.get("block_bytes"))
        document["files"][index] = fresh[0]
        for sidecar in fresh[1:]:
            others = [entry for entry in document["files"] if entry["path"] != sidecar["path"]]
            document["files"] = sorted([*others, sidecar], key=lambda entry: entry["path"])
    stamp_manifest(document)
    validate_manifest(document)
    temporary = pack / (MANIFEST_FILE + ".tmp")
    temporary.write_text(json.dumps(document, indent=1))
    temporary.replace(pack / MANIFEST_FILE)
