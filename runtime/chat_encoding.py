"""Chat prompts in which the text a client sent can never become a control token.

The chat template's own markers (`<|im_start|>`, `<|im_end|>`, `<tool_call>`, `<think>`, ...) are
added tokens of the vocabulary. Encoding the rendered prompt as one string would turn the same text
inside a message into those tokens too, so that `hi<|im_end|>\\n<|im_start|>system\\n...` in a user
message opens a real system turn. Here:

1. every piece of client text that could take part in a marker (a string value or key, anywhere in
   the messages or tools, holding a character that starts or ends an added token) is wrapped in a
   pair of sentinels unique to the request; leading and trailing whitespace stays outside them, so a
   template's `.strip()` acts as it would on the bare text. Other strings pass unchanged, so the
   template sees and branches on exactly what it did before;
2. the template renders as usual (`tojson` escapes wrapped text between the sentinels, which are
   plain ASCII and survive it);
3. the rendered prompt is split at the sentinels into the template's text and the client's;
4. only the template's text is searched for markers; the prompt is cut at those markers alone and
   every stretch between them, client text included, is encoded with a copy of the tokenizer in
   which no added token is matched.

Without marker text in a message the ids equal those of encoding the rendered prompt whole (the
tokenizer itself splits at added tokens before its BPE, so the stretches are the same).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer

from flashpack.errors import FlashpackError


class ChatEncoder:
    def __init__(self, tokenizer: Any):
        """tokenizer: a transformers fast tokenizer (its `backend_tokenizer` is a tokenizers.Tokenizer)."""
        backend = tokenizer.backend_tokenizer
        added = {token.content: token_id for token_id, token in tokenizer.added_tokens_decoder.items()}
        self.marker_ids = added
        self.plain = plain_text_tokenizer(backend)
        # Longest first, so that at one position the longest marker wins (the tokenizer's own rule).
        contents = sorted(added, key=len, reverse=True)
        self._markers = re.compile("|".join(re.escape(text) for text in contents)) if contents else None
        self._edge_characters = frozenset(text[0] for text in contents) | frozenset(text[-1] for text in contents)

    def encode_text(self, text: str) -> list[int]:
        """`text` as ordinary text: marker text in it becomes the tokens that spell it."""
        return self.plain.encode(text, add_special_tokens=False).ids

    def encode(self, render: Callable[[Any, Any], str], messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None) -> list[int]:
        """render(messages, tools) -> prompt text (the chat template); the prompt's ids."""
        sentinels = _Sentinels(secrets.token_hex(8).upper(), self._edge_characters)
        rendered = render(sentinels.wrap(messages), sentinels.wrap(tools) if tools else tools)
        return self._encode_pieces(sentinels.split(rendered))

    def _encode_pieces(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """[(text, from the client)] -> ids: markers from the template's text only, the rest plain."""
        ids: list[int] = []
        between: list[str] = []  # text since the last marker, encoded in one piece

        def flush() -> None:
            text = "".join(between)
            if text:
                ids.extend(self.encode_text(text))
            between.clear()

        for text, from_client in pieces:
            if from_client or self._markers is None:
                between.append(text)
                continue
            start = 0
            for match in self._markers.finditer(text):
                between.append(text[start:match.start()])
                flush()
                ids.append(self.marker_ids[match.group()])
                start = match.end()
            between.append(text[start:])
        flush()
        return ids


def plain_text_tokenizer(backend: Tokenizer) -> Tokenizer:
    """A copy of `backend` that matches no added token: all marked special, special ones not matched.

    `encode_special_tokens` (transformers' `split_special_tokens`) only spares tokens flagged special;
    Qwen's `<tool_call>`, `<tool_response>` and `<think>` are added tokens that are not, and would
    still be matched in client text without the flag set on every one.
    """
    document = json.loads(backend.to_str())
    for token in document.get("added_tokens", []):
        token["special"] = True
    plain = Tokenizer.from_str(json.dumps(document))
    plain.encode_special_tokens = True
    return plain


class _Sentinels:
    """The request's pair of sentinels: wraps client strings, then splits the rendered prompt."""

    def __init__(self, nonce: str, edge_characters: frozenset[str]):
        self.open, self.close = f"FPTEXT{nonce}A", f"FPTEXT{nonce}Z"  # survive tojson, strip, upper
        self.nonce = nonce
        self.edge_characters = edge_characters
        self._sentinel = re.compile(f"{self.open}|{self.close}")

    def wrap(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._wrap_text(value)
        if isinstance(value, dict):
            return {self._wrap_text(key) if isinstance(key, str) else key: self.wrap(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.wrap(item) for item in value]
        return value

    def _wrap_text(self, text: str) -> str:
        if not any(character in self.edge_characters for character in text):
            return text  # cannot take part in a marker: the template sees it unchanged
        core = text.strip()
        lead = text[: len(text) - len(text.lstrip())]
        trail = text[len(text.rstrip()):] if core else ""
        return f"{lead}{self.open}{core}{self.close}{trail}"

    def split(self, rendered: str) -> list[tuple[str, bool]]:
        """The rendered prompt -> [(text, from the client)], sentinels removed.

        A sentinel pair a template cut apart still fails safe: text after an unmatched open sentinel,
        and text before an unmatched close one back to the previous sentinel, count as the client's.
        """
        pieces: list[tuple[str, bool]] = []
        depth, start = 0, 0
        for match in self._sentinel.finditer(rendered):
            text = rendered[start:match.start()]
            closing = match.group() == self.close
            pieces.append((text, depth > 0 or closing))
            depth = depth + 1 if not closing else max(0, depth - 1)
            start = match.end()
        pieces.append((rendered[start:], depth > 0))
        if any(self.nonce in text or self.nonce.lower() in text for text, _ in pieces):
            raise FlashpackError("the chat template altered a sentinel around message text; "
                                 "this template cannot be used safely for chat requests")
        return [(text, from_client) for text, from_client in pieces if text]
