"""The server's refusals in OpenAI's error shape, and the bounds of one request.

`RequestError` is every refusal of a request: its HTTP status, OpenAI's `type`, the offending
`param` and a `code`; `error_body` is the JSON a client gets. `shown` writes a value as a
refusal quotes it. The request models (requests.py) check each field against these bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from onnx_chunk.errors import InputError

MAX_STOPS = 4
# The most choices per prompt (`n`) and prompts per request: each is one engine request.
MAX_N = 16
MAX_PROMPTS = 64


class RequestError(InputError):
    """A request the server refuses, in OpenAI's error shape: HTTP `status`, `type`, the
    offending `param` and a `code`."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status
        self.error_type = error_type


def error_body(message: str, error_type: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def shown(value: object) -> str:
    """A value as an error message shows it: a short repr and its JSON type."""
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({_json_type(value)})"


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Sequence):
        return "array"
    return "object"
