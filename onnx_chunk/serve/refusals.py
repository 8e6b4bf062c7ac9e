"""The answer of a refused or failed request, in OpenAI's error shape.

`error_answer` maps a failure to its status, body and headers: a RequestError as it says; the
grammar library's failure on a schema, the sandbox's refusal of a template, any other input
error 400; the model's own chat template failing and a defect 500 (logged, never sent as a
traceback); a full queue 429 with Retry-After; a closed server 503. `drop_tracebacks` lets an
answered failure go at once.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from onnx_chunk.errors import ClosedError, ConfigError, InputError, QueueFullError
from onnx_chunk.serve.protocol import RequestError, error_body
from onnx_chunk.text.chat_template import ChatTemplateFault, ChatTemplateSandboxError

logger = logging.getLogger(__name__)

# Seconds a client told "queue full" (429) waits before it retries.
RETRY_AFTER_S = 1


def error_answer(error: Exception) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The status, OpenAI error body and headers of a refused or failed request."""
    if isinstance(error, RequestError):
        return error.status, error_body(str(error), error.error_type, param=error.param,
                                        code=error.code), {}
    from onnx_chunk.structured.constraint import GrammarError

    if isinstance(error, GrammarError):  # the request's schema beyond the grammar library
        return 400, error_body(f"the grammar of this request's schema failed: {error}; "
                               "simplify the schema", "invalid_request_error",
                               param="response_format", code="grammar_failed"), {}
    if isinstance(error, ChatTemplateSandboxError):  # what a template reached for: refused
        return 400, error_body(str(error), "invalid_request_error", param="messages",
                               code="chat_template_sandbox"), {}
    if isinstance(error, ChatTemplateFault):  # the model's template: the server's fault
        logger.error("the chat template failed a request: %s", error, exc_info=error)
        return 500, error_body(str(error), "server_error", code="chat_template_failed"), {}
    if isinstance(error, (InputError, ConfigError)):
        return 400, error_body(str(error), "invalid_request_error"), {}
    if isinstance(error, QueueFullError):
        return 429, error_body(str(error), "rate_limit_error", code="queue_full"), {
            "Retry-After": str(RETRY_AFTER_S)}
    if isinstance(error, ClosedError):
        return 503, error_body(str(error), "server_error", code="server_shutting_down"), {}
    logger.error("a request failed", exc_info=error)
    return 500, error_body("the server failed this request (logged on the server)",
                           "server_error", code="internal_error"), {}


def drop_tracebacks(error: BaseException) -> None:
    """Let go of an answered failure's tracebacks (its causes' too). A failure raised on a
    worker thread reaches the loop through a future that its traceback's frames hold, a
    reference cycle that would keep the request's body, prompts and model until the garbage
    collector's next full pass; without the tracebacks the refusal frees them at once."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += [current.__cause__, current.__context__]


async def http_error(request: HttpRequest, error: Exception) -> Response:
    """Starlette's own refusals (unknown route, wrong method) in OpenAI's shape."""
    assert isinstance(error, HTTPException)  # the handler is registered for it alone
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {error.detail}",
                                   "invalid_request_error", code=str(error.status_code)),
                        status_code=error.status_code, headers=error.headers)


def answer_too_large(size: str, limit: int, param: str | None = None) -> RequestError:
    return RequestError(f"the answer would have {size}, more than the {limit} bytes this "
                        "server sends for one request (its --max-answer-bytes); ask for fewer "
                        "prompts, choices, tokens or logprobs", param=param,
                        code="answer_too_large")


def too_large(size: str, limit: int) -> RequestError:
    return RequestError(f"the request body has {size}, more than the {limit} bytes this "
                        "server reads (its --max-body-bytes); send a smaller request",
                        code="request_too_large", status=413)
