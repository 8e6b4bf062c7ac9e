"""An OpenAI-compatible HTTP server on a runtime's batch engine (Starlette, SSE streaming).

`create_app(runtime)` gives an ASGI app; `onnx-chunk serve` runs it under uvicorn. Every
generation is one `Runtime.submit`; the answers:
- 200: chat.completion / text_completion, or an event stream of chunks ending in `[DONE]`;
- 400: a malformed body, a field of the wrong type or range, a prompt over the context (with
  the numbers); 401: a missing or wrong `Authorization: Bearer KEY` (when the app has a key;
  /health and /metrics stay open); 404: an unknown route or model; 429 with Retry-After: the
  engine's queue is full; 503: the server is draining; 500: a defect (logged here, never sent
  as a traceback). Every error body has OpenAI's shape.
A client that disconnects cancels its request (its slot is freed at once). `drain()` (SIGTERM
in `onnx-chunk serve`) stops admitting and ends the running requests; a stream then gets an
error event in place of its last chunk.
"""

from __future__ import annotations

import abc
import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from onnx_chunk.errors import (
    CapacityError,
    ClosedError,
    ConfigError,
    InputError,
    OnnxChunkError,
    QueueFullError,
)
from onnx_chunk.sampling import Sampling
from onnx_chunk.serve.generation import ServedGeneration
from onnx_chunk.serve.metrics import CONTENT_TYPE, ServerMetrics
from onnx_chunk.serve.protocol import (
    GenerationParams,
    RequestError,
    error_body,
    parse_chat,
    parse_completion,
)
from onnx_chunk.text.generation import prompt_ids
from onnx_chunk.text.token_text import TokenText

if TYPE_CHECKING:
    from onnx_chunk.runtime.engine import Runtime
    from onnx_chunk.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Seconds a client told "queue full" (429) waits before it retries.
RETRY_AFTER_S = 1


def create_app(runtime: Runtime, *, model_name: str | None = None,
               api_key: str | None = None) -> Starlette:
    """The ASGI app serving `runtime` (see the module docstring); `app.state.service.drain()`
    stops it admitting. The caller owns the runtime (and closes it after the server)."""
    service = _Service(runtime, model_name or runtime.model_path.parent.name, api_key)
    routes = [
        Route("/v1/chat/completions", service.endpoint(service.chat_completions),
              methods=["POST"]),
        Route("/v1/completions", service.endpoint(service.completions), methods=["POST"]),
        Route("/v1/models", service.endpoint(service.models), methods=["GET"]),
        Route("/health", service.health, methods=["GET"]),
        Route("/metrics", service.metrics_page, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.service = service
    return app


class _Service:
    """The app's state: the runtime, its tokenizer, the metrics, the live generations."""

    def __init__(self, runtime: Runtime, model_name: str, api_key: str | None) -> None:
        self.runtime = runtime
        self.model_name = model_name
        # Read now: a model folder without a tokenizer fails at start, not per request.
        self.tokenizer: Tokenizer = runtime.tokenizer
        self.metrics = ServerMetrics(runtime)
        self._api_key = api_key
        self._created = int(time.time())
        self._live: set[ServedGeneration] = set()
        self.draining = False

    def drain(self) -> None:
        """Stop admitting requests and end the running ones (their streams get an error)."""
        self.draining = True
        for generation in list(self._live):
            generation.end_for_shutdown()
        logger.info("draining: %d running request(s) ended", len(self._live))

    def endpoint(self, handler: Callable[[HttpRequest], Awaitable[_Reply]]
                 ) -> Callable[[HttpRequest], Awaitable[_Reply]]:
        """`handler` behind the key check, with every failure turned into an error body."""
        async def run(request: HttpRequest) -> _Reply:
            try:
                self._authorize(request)
                return await handler(request)
            except Exception as error:  # every failure becomes one OpenAI-shaped answer
                return self._error_response(error)
        return run

    async def chat_completions(self, request: HttpRequest) -> _Reply:
        arrived = time.perf_counter()
        params = parse_chat(await _json_body(request))
        return await self._serve(request, params, arrived, chat=True)

    async def completions(self, request: HttpRequest) -> _Reply:
        arrived = time.perf_counter()
        params = parse_completion(await _json_body(request))
        return await self._serve(request, params, arrived, chat=False)

    async def models(self, request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self._created,
             "owned_by": "onnx-chunk", "max_model_len": self.runtime.capacity}]})

    async def health(self, request: HttpRequest) -> Response:
        if self.draining or self.runtime.closed:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_page(self, request: HttpRequest) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def _serve(self, request: HttpRequest, params: GenerationParams, arrived: float, *,
                     chat: bool) -> _Reply:
        try:
            generation = self._start(params, arrived)
        except CapacityError as error:
            raise RequestError(str(error), param="messages" if chat else "prompt",
                               code="context_length_exceeded") from error
        answer = _ChatAnswer(self.model_name) if chat else _TextAnswer(self.model_name)
        self._live.add(generation)
        if params.stream:
            return _EventStream(self._events(generation, answer, params.include_usage),
                                lambda: self._ended(generation))
        try:
            text = await _unless_disconnected(_collect(generation.pieces()), request.receive)
        finally:
            self._ended(generation)
        if text is None:
            return Response(status_code=499)
        return JSONResponse(answer.whole(text, generation.finish_reason,
                                         _usage(generation)))

    def _ended(self, generation: ServedGeneration) -> None:
        generation.close()
        self._live.discard(generation)

    def _start(self, params: GenerationParams, arrived: float) -> ServedGeneration:
        """Check, tokenize and submit one request (every refusal raised before any work)."""
        if self.draining:
            raise ClosedError("the server is shutting down")
        if params.model is not None and params.model != self.model_name:
            raise RequestError(f"the model {params.model!r} is not served here; this server "
                               f"serves {self.model_name!r} (GET /v1/models)", param="model",
                               code="model_not_found", status=404)
        runtime, tokenizer = self.runtime, self.tokenizer
        if params.messages:
            ids = prompt_ids(tokenizer, list(params.messages))
        elif isinstance(params.prompt, str):
            ids = prompt_ids(tokenizer, params.prompt)
        else:
            ids = list(params.prompt)
        room = runtime.capacity - len(ids)
        if params.max_tokens is None and room < 1:
            raise CapacityError(f"the prompt has {len(ids)} tokens and the context holds "
                                f"{runtime.capacity}, leaving no room for a new token; "
                                "shorten the prompt")
        search = {} if runtime.genai is None else runtime.genai.search
        sampling = Sampling.from_search(search, temperature=params.temperature,
                                        top_p=params.top_p, seed=params.seed)
        request = runtime.submit(ids, params.max_tokens or room,
                                 eos_token_id=tokenizer.eos_token_ids or None,
                                 sampling=sampling)
        return ServedGeneration(request, TokenText(tokenizer, params.stop), len(ids), arrived,
                                self.metrics)

    async def _events(self, generation: ServedGeneration, answer: _Answer,
                      include_usage: bool) -> AsyncGenerator[bytes, None]:
        try:
            yield _event(answer.chunk(answer.opening, None))
            async for piece in generation.pieces():
                yield _event(answer.chunk(piece, None))
            yield _event(answer.chunk(answer.closing, generation.finish_reason))
            if include_usage:
                yield _event(answer.usage_chunk(_usage(generation)))
            yield b"data: [DONE]\n\n"
        except ClosedError as error:
            yield _event(error_body(str(error), "server_error", code="server_shutting_down"))
        except OnnxChunkError as error:
            logger.warning("request %d failed: %s", generation.request.id, error)
            yield _event(error_body(str(error), "server_error", code="generation_failed"))
        except Exception:
            logger.exception("request %d failed", generation.request.id)
            yield _event(error_body("the server failed this request (logged on the server)",
                                    "server_error", code="internal_error"))

    def _authorize(self, request: HttpRequest) -> None:
        if self._api_key is None:
            return
        given = request.headers.get("authorization", "")
        expected = f"Bearer {self._api_key}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise RequestError("missing or wrong API key: send 'Authorization: Bearer KEY' "
                               "with the key the server was started with",
                               code="invalid_api_key", status=401)

    def _error_response(self, error: Exception) -> Response:
        status, body, headers = _error_answer(error)
        self.metrics.rejected.labels(status=str(status)).inc()
        return JSONResponse(body, status_code=status, headers=headers)


def _error_answer(error: Exception) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The status, OpenAI error body and headers of a refused or failed request."""
    if isinstance(error, RequestError):
        return error.status, error_body(str(error), error.error_type, param=error.param,
                                        code=error.code), {}
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


async def _http_error(request: HttpRequest, error: Exception) -> Response:
    """Starlette's own refusals (unknown route, wrong method) in OpenAI's shape."""
    assert isinstance(error, HTTPException)  # the handler is registered for it alone
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {error.detail}",
                                   "invalid_request_error", code=str(error.status_code)),
                        status_code=error.status_code, headers=error.headers)


async def _json_body(request: HttpRequest) -> object:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON ({error}); send a JSON object",
                           code="invalid_json") from error


async def _collect(pieces: AsyncIterator[str]) -> str:
    return "".join([piece async for piece in pieces])


async def _unless_disconnected(work: Awaitable[str], receive: Receive) -> str | None:
    """`work`'s result, or None when the client disconnected first (`work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream:
    """An ASGI response streaming server-sent events that watches for the client leaving:
    a disconnect cancels the stream at once (Starlette's StreamingResponse only notices one
    at its next write), then `on_end` runs."""

    def __init__(self, events: AsyncGenerator[bytes, None], on_end: Callable[[], None]) -> None:
        self._events = events
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            await _unless_disconnected(self._pump(send), receive)
        except OSError:  # the client went away during a write
            pass
        finally:
            await self._events.aclose()
            self._on_end()

    async def _pump(self, send: Send) -> str:
        async for event in self._events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return ""


# What an endpoint replies: a whole response, or a stream of events.
_Reply = Response | _EventStream


def _event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def _usage(generation: ServedGeneration) -> dict[str, int]:
    return {"prompt_tokens": generation.prompt_tokens,
            "completion_tokens": generation.completion_tokens,
            "total_tokens": generation.prompt_tokens + generation.completion_tokens}


class _Answer(abc.ABC):
    """The response objects of one endpoint (one id and creation time per request):
    `opening` and `closing` are the first and last chunks' contents."""

    object_name: str
    chunk_name: str
    prefix: str
    opening: Any
    closing: Any

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, name: str) -> dict[str, Any]:
        return {"id": self.id, "object": name, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str | None, usage: dict[str, int]
              ) -> dict[str, Any]:
        return {**self._head(self.object_name), "choices": [self.choice(text, finish_reason)],
                "usage": usage}

    def chunk(self, piece: Any, finish_reason: str | None) -> dict[str, Any]:
        return {**self._head(self.chunk_name),
                "choices": [self.chunk_choice(piece, finish_reason)]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._head(self.chunk_name), "choices": [], "usage": usage}

    @abc.abstractmethod
    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        """The choice of the whole answer."""

    @abc.abstractmethod
    def chunk_choice(self, piece: Any, finish_reason: str | None) -> dict[str, Any]:
        """The choice of one streamed chunk."""


class _ChatAnswer(_Answer):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"
    prefix = "chatcmpl"
    opening = {"role": "assistant", "content": ""}
    closing: dict[str, str] = {}

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, piece: Any, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": piece} if isinstance(piece, str) else piece
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


class _TextAnswer(_Answer):
    object_name = "text_completion"
    chunk_name = "text_completion"
    prefix = "cmpl"
    opening = ""
    closing = ""

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, piece: Any, finish_reason: str | None) -> dict[str, Any]:
        return self.choice(piece, finish_reason)
