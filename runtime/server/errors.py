"""API errors in each API's own shape.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}

Which shape a response takes follows the path: /v1/messages* is Anthropic's, the rest OpenAI's.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse

_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    503: "overloaded_error", 529: "overloaded_error",
}
_OPENAI_TYPES = {
    400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
    404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
    429: "rate_limit_error", 500: "server_error", 503: "server_error",
}


class ApiError(Exception):
    """A request the server refuses or could not serve; `status` picks the HTTP code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def is_anthropic_path(path: str) -> bool:
    return path.rstrip("/").startswith("/v1/messages")


def openai_error_body(error: ApiError) -> dict[str, Any]:
    kind = _OPENAI_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


def anthropic_error_body(error: ApiError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_body(path: str, error: ApiError) -> dict[str, Any]:
    return anthropic_error_body(error) if is_anthropic_path(path) else openai_error_body(error)


def error_response(path: str, error: ApiError) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error_body(path, error), status_code=error.status, headers=headers)


def body_parse_error(cause: BaseException) -> ApiError | None:
    """Why FastAPI could not parse a body (it only says "There was an error parsing the body")."""
    if isinstance(cause, UnicodeDecodeError):
        return ApiError(400, f"the request body is not valid UTF-8: {cause.reason} at byte {cause.start}",
                        code="invalid_encoding")
    if isinstance(cause, RecursionError):
        return ApiError(400, "the request body is nested too deeply", code="invalid_value")
    if isinstance(cause, ValueError):  # e.g. an integer literal past Python's 4,300 digits
        return ApiError(400, f"the request body is not valid JSON: {cause}", code="invalid_value")
    return None


def validation_error(exc: RequestValidationError) -> ApiError:
    """pydantic's first complaint as a 400: malformed JSON, a missing field, a wrong type or range."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request")
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(": "))
    param = ".".join(location) or None
    message = first.get("msg", "invalid value")
    return ApiError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")
