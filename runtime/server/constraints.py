"""Grammar-constrained decoding with llguidance: JSON schemas and forced tool calls.

llguidance compiles a Lark grammar (with JSON schemas embedded as `%json {...}`) against the
tokenizer's vocabulary and, each step, computes the set of tokens that keep the output inside the
grammar; everything else is masked to -inf before sampling. So a forced tool call is valid JSON for
its schema whatever the model would have preferred. JSON is generated compactly (no free
whitespace): a model that likes spaces must not be able to pad forever.

Building the vocabulary view (`LLTokenizer`) takes about a second for a real vocabulary, so a
`GrammarCompiler` does it once per engine and then compiles one matcher per request; the same view
gives each token's exact bytes to the log-probabilities a reply reports (`token_bytes`).

A tool's parameters schema sits inside the call schema, so its local references (`#/$defs/City`,
`#` itself) would point into the wrong document: each tool's schema moves whole under the call
schema's `$defs` (as `tool_0`, `tool_1`, ...) with its references re-rooted there.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from flashpack.runtime.server.errors import ApiError
from flashpack.runtime.server.markers import CALL_CLOSE, CALL_OPEN, Markers

_COMPACT = {"whitespace_flexible": False, "lenient": True}  # lenient: ignore keywords it cannot enforce
_LEADING_NEWLINES = r"/\n{0,2}/"
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


class GrammarConstraint:
    """TokenConstraint over one llguidance matcher."""

    def __init__(self, matcher: llguidance.LLMatcher, stop_ids: Sequence[int]):
        self.matcher = matcher
        self.stop_ids = list(stop_ids)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """float [vocab] -> float [vocab] with the grammar's disallowed tokens at -inf."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: logits.shape[-1]].astype(bool)
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
        keep[: allowed.shape[0]] = torch.from_numpy(allowed)
        if not keep.any():  # an error state: allow only ending the turn rather than sampling from nothing
            keep[self.stop_ids] = True
        return logits.masked_fill(~keep.to(logits.device), float("-inf"))

    def accept(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.stop_ids = list(stop_ids)
        self.markers = Markers(tokenizer)
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    def warm(self) -> None:
        self._vocabulary()

    def json_schema(self, schema: dict[str, Any]) -> GrammarConstraint:
        """An answer that is one JSON value valid for `schema` ({"type": "object"} for json_object)."""
        return self._compile(f"start: {_LEADING_NEWLINES} answer\nanswer: %json {_compact(schema)}")

    def tool_calls(self, tools: list[dict[str, Any]], several: bool) -> GrammarConstraint:
        """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, one call (or several) of `tools`.

        tools: [{"name": str, "parameters": JSON schema}], already validated.
        """
        definitions: dict[str, Any] = {}
        calls = []
        for index, tool in enumerate(tools):
            key = f"tool_{index}"
            definitions[key] = _rerooted(_arguments_schema(tool.get("parameters")), f"#/$defs/{key}")
            calls.append(_call_schema(tool["name"], {"$ref": f"#/$defs/{key}"}))
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {**schema, "$defs": definitions}
        repeat = "+" if several else ""
        grammar = (
            f"start: {_LEADING_NEWLINES} (call_block){repeat}\n"
            f'call_block: {self.markers.lark(CALL_OPEN)} "\\n" call "\\n" {self.markers.lark(CALL_CLOSE)} /\\n?/\n'
            f"call: %json {_compact(schema)}"
        )
        return self._compile(grammar)

    def _compile(self, lark: str) -> GrammarConstraint:
        vocabulary = self._vocabulary()
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, vocabulary)
        if is_error:
            raise ApiError(400, f"the schema cannot be enforced: {_first_line(messages)}", code="invalid_schema")
        matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0)
        if matcher.is_error():
            raise ApiError(400, f"the schema cannot be enforced: {_first_line([matcher.get_error()])}",
                           code="invalid_schema")
        return GrammarConstraint(matcher, self.stop_ids)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's bytes as the tokenizer writes them (a special token as its text): what logprobs report."""
        return self._vocabulary().decode_bytes([token_id])

    def _vocabulary(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.stop_ids or None
                )
            return self._ll_tokenizer


def _arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    # A function declared without parameters takes none (as OpenAI reads it): exactly {}.
    return parameters if parameters else {"type": "object", "properties": {}, "additionalProperties": False}


def _rerooted(schema: Any, root: str) -> Any:
    """`schema` with every local `$ref` ("#...") moved under `root`; values that are data (const,
    enum, default, examples) are left as they are."""
    if isinstance(schema, list):
        return [_rerooted(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            moved[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            moved[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):  # its keys are names, not keywords
            moved[key] = {name: _rerooted(item, root) for name, item in value.items()}
        else:
            moved[key] = _rerooted(value, root)
    return moved


def _call_schema(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _compact(schema: dict[str, Any]) -> str:
    if not isinstance(schema, dict):
        raise ApiError(400, "a JSON schema must be an object", code="invalid_schema")
    schema = copy.deepcopy(schema)
    schema["x-guidance"] = {**schema.get("x-guidance", {}), **_COMPACT}
    return json.dumps(schema)


def _first_line(messages: list[str]) -> str:
    text = (messages[0] if messages else "unknown error").strip()
    return text.splitlines()[0] if text else "unknown error"
