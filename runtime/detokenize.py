"""Streaming text out of token ids: incremental detokenisation and stop strings.

Decoding the whole output every step costs O(n) per token; instead we decode a short window that
starts a few tokens back (so merges and multi-byte characters settle) and emit only what is new.
A stop string may straddle tokens, so text that could still become one is held back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_INCOMPLETE = "\ufffd"  # what a tokenizer prints for a partial UTF-8 sequence


@dataclass
class IncrementalDetokenizer:
    tokenizer: object  # anything with decode(ids, skip_special_tokens=...)
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self._prefix_offset:self._read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.ids[self._prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        return full[len(prefix):]


@dataclass
class StopStringFilter:
    """Passes text through until a stop string appears; holds back a possible stop-string prefix."""

    stop_strings: tuple[str, ...]
    _pending: str = ""
    stopped: bool = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self._pending += text
        hits = [(self._pending.find(s), s) for s in self.stop_strings if s and s in self._pending]
        if hits:
            cut = min(position for position, _ in hits)
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        keep = self._held_back_length()
        out = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        return out

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _held_back_length(self) -> int:
        longest = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(self._pending)), 0, -1):
                if stop.startswith(self._pending[-length:]):
                    longest = max(longest, length)
                    break
        return longest
