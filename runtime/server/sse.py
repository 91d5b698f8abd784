"""Server-sent events: the framing both APIs stream in, and the response that carries them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def data_event(payload: Any) -> str:
    """OpenAI's framing: `data: {...}` and a blank line."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def named_event(name: str, payload: Any) -> str:
    """Anthropic's framing: `event: <type>`, then the data line."""
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """Closing the response (client gone) closes `events`, whose cleanup cancels the generation."""
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
