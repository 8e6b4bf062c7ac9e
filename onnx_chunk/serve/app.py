"""An OpenAI-compatible HTTP server on a runtime's batch engine (Starlette, SSE streaming).

`create_app(runtime)` gives an ASGI app; `onnx-chunk serve` runs it under uvicorn. Every
prompt of a request is one `Runtime.submit_choices` of its `n` choices (one prefill); the
answers:
- 200: chat.completion / text_completion, or an event stream of chunks ending in `[DONE]`;
- 400: a malformed body (not JSON, nested too deep, a lone surrogate), a field of the wrong
  type or range, a prompt over the context (with the numbers); 401: a missing or wrong
  `Authorization: Bearer KEY` (when the app has a key; /health and /metrics stay open); 404: an
  unknown route or model; 413: a body over `max_body_bytes`; 429 with Retry-After: the
  engine's queue is full; 503: the server is draining; 500: a defect, or the model's chat
  template failing (logged here, never sent as a traceback). Every error body has OpenAI's
  shape.
The event loop only moves bytes and tokens: a request's body is parsed, its template rendered
and its prompt encoded on a worker thread, each bounded by the context before the whole
prompt is encoded (the tokenizer's `check_fits`, the template's `max_chars`).
A client that disconnects cancels its request (its slot is freed at once); one that leaves
while it uploads its body is logged (info) and not counted as an error. `drain()` (SIGTERM
in `onnx-chunk serve`) stops admitting and ends the running requests; a stream then gets an
error event in place of its last chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from onnx_chunk.errors import (
    CapacityError,
    ClosedError,
    ConfigError,
    OnnxChunkError,
)
from onnx_chunk.sampling import Sampling, TokenLogprobs
from onnx_chunk.serve.answers import (
    Answer,
    ChatAnswer,
    TextAnswer,
    collect_chunks,
    encode_json,
    event,
    usage,
)
from onnx_chunk.serve.body import decode_body
from onnx_chunk.serve.generation import ServedGeneration
from onnx_chunk.serve.logprobs import TokenIds, TokenStrings
from onnx_chunk.serve.metrics import CONTENT_TYPE, ServerMetrics
from onnx_chunk.serve.parameters import RequestOptions
from onnx_chunk.serve.prompts import chat_ids, check_room, completion_ids
from onnx_chunk.serve.protocol import RequestError, error_body
from onnx_chunk.serve.refusals import (
    answer_too_large,
    drop_tracebacks,
    error_answer,
    http_error,
    too_large,
)
from onnx_chunk.serve.requests import ChatCompletionRequest, CompletionRequest
from onnx_chunk.serve.streaming import EventStream, unless_disconnected
from onnx_chunk.serve.tokenize import detokenize, tokenize
from onnx_chunk.text.generation import search_defaults
from onnx_chunk.text.prompt import PromptEncoder
from onnx_chunk.text.token_text import TokenText
from onnx_chunk.text.tokenizer import tokenizer_of

if TYPE_CHECKING:
    from onnx_chunk.runtime.facade import Runtime
    from onnx_chunk.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# The largest request body read (413 beyond): a prompt that fills a 128k-token context is at
# most about 3 MB of JSON (4 characters a token, each escaped as 6 bytes: `\u00e9`), its
# token ids about 1 MB; 8 MiB leaves room for those and caps what one request makes the
# server hold and parse.
DEFAULT_MAX_BODY_BYTES = 8 << 20
# The largest answer one request may make (400 `answer_too_large` past it): a whole answer's
# JSON, or the bytes of a stream. A request whose logprobs alone cannot fit (answer_size.py)
# is refused before it is queued.
DEFAULT_MAX_ANSWER_BYTES = 32 << 20


def create_app(runtime: Runtime, *, model_name: str | None = None,
               api_key: str | Sequence[str] | None = None, share_prefixes: bool = False,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
               parse_special_in_content: bool = False,
               trust_request_chat_template: bool = False) -> Starlette:
    """The ASGI app serving `runtime` (see the module docstring); `app.state.service.drain()`
    stops it admitting. The caller owns the runtime (and closes it after the server).

    api_key: the key (or keys) a request must send as `Authorization: Bearer KEY`; None: any
        request is served.
    share_prefixes: the requests of different keys reuse each other's prompt prefixes (by
        default a key's requests reuse only its own; `cache_salt` narrows it further).
    max_body_bytes: bodies larger are refused (413).
    max_answer_bytes: answers larger are refused (400 `answer_too_large`; see
        DEFAULT_MAX_ANSWER_BYTES).
    parse_special_in_content: special tokens typed in messages become control tokens, as
        transformers' apply_chat_template makes them; by default they are text, as OpenAI's
        API treats them (a user cannot forge a turn).
    trust_request_chat_template: a request's own `chat_template` is rendered (in the same
        sandbox); by default it is refused (400), as vLLM refuses it without
        `--trust-request-chat-template` (vllm/entrypoints/openai/serving_engine.py,
        `_validate_chat_template`).
    Faults of the model folder that would fail every request (a chat template that does not
    compile, genai_config's `search` out of range) raise here, at start.
    """
    for name, value in (("max_body_bytes", max_body_bytes),
                        ("max_answer_bytes", max_answer_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if any(not isinstance(key, str) or not key.strip() for key in keys):
        raise ConfigError("an API key must be a non-empty string")
    service = _Service(runtime, model_name or Path(runtime.stats.model).parent.name, keys,
                       max_body_bytes, parse_special_in_content, trust_request_chat_template)
    service.max_answer_bytes = max_answer_bytes
    service.share_prefixes = share_prefixes
    routes = [
        Route("/v1/chat/completions", service.endpoint(service.chat_completions),
              methods=["POST"]),
        Route("/v1/completions", service.endpoint(service.completions), methods=["POST"]),
        Route("/v1/models", service.endpoint(service.models), methods=["GET"]),
        Route("/tokenize", service.endpoint(service.tokenize), methods=["POST"]),
        Route("/detokenize", service.endpoint(service.detokenize), methods=["POST"]),
        Route("/health", service.health, methods=["GET"]),
        Route("/metrics", service.metrics_page, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.state.service = service
    return app


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A request parsed, checked and encoded, with its sampling and end tokens."""

    options: RequestOptions
    # Each prompt as the request gave it (chat: none) and its token ids (chat: one).
    texts: tuple[str | tuple[int, ...], ...]
    prompts: list[list[int]]
    # Each choice's text: its detokenization fields (vLLM's).
    text_options: dict[str, bool]
    sampling: Sampling
    ends: tuple[int, ...]


class _Service:
    """The app's state: the runtime, its tokenizer, the metrics, the live generations."""

    def __init__(self, runtime: Runtime, model_name: str, api_keys: list[str],
                 max_body_bytes: int, parse_special_in_content: bool,
                 trust_request_chat_template: bool = False) -> None:
        self.runtime = runtime
        self.model_name = model_name
        # What a loaded runtime never changes, read once (a stats snapshot is not free).
        configuration = runtime.stats
        self.capacity = configuration.capacity
        self.vocab_size = configuration.vocab_size
        self.eos_token_ids = configuration.eos_token_ids
        # Read now: a model folder without a tokenizer, with a chat template that does not
        # compile or with a bad `search` fails at start, not at every request.
        self.tokenizer: Tokenizer = tokenizer_of(runtime)
        _ = self.tokenizer.chat_template, self.tokenizer.max_token_chars
        self.search = search_defaults(self.tokenizer)
        # The one encoder of every prompt the server feeds or /tokenize counts.
        self.prompts = PromptEncoder(self.tokenizer, special_in_content=parse_special_in_content,
                                     max_tokens=self.capacity,
                                     request_templates=trust_request_chat_template)
        self.max_body_bytes = max_body_bytes
        self.max_answer_bytes = DEFAULT_MAX_ANSWER_BYTES
        self.metrics = ServerMetrics(runtime)
        self.strings = TokenStrings(self.tokenizer)
        self.token_ids = TokenIds(self.tokenizer)
        self.api_keys = api_keys
        self.share_prefixes = False
        self._created = int(time.time())
        self._live: set[ServedGeneration] = set()
        self.draining = False

    @property
    def running(self) -> int:
        """The generations whose answer is still being sent."""
        return len(self._live)

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
                request.state.tenant = self._authorize(request)
                return await handler(request)
            except ClientDisconnect:  # nobody is left to answer; not the server's failure
                logger.info("a client left during its upload to %s", request.url.path)
                return Response(status_code=499)
            except Exception as error:  # every failure becomes one OpenAI-shaped answer
                response = self._error_response(error)
                drop_tracebacks(error)
                return response
        return run

    async def chat_completions(self, request: HttpRequest) -> _Reply:
        return await self._generate(request, chat=True)

    async def completions(self, request: HttpRequest) -> _Reply:
        return await self._generate(request, chat=False)

    async def _generate(self, request: HttpRequest, *, chat: bool) -> _Reply:
        arrived = time.perf_counter()
        body = await self._body(request)
        try:
            # Off the loop: parsing, encoding, the grammar's compilation and each choice's
            # matcher (built with its sampler at submit) grow with what the client sends.
            prepared, generations = await run_in_threadpool(self._admit, body, chat, arrived,
                                                            request.state.tenant)
        except CapacityError as error:
            raise RequestError(str(error), param="messages" if chat else "prompt",
                               code="context_length_exceeded") from error
        return await self._serve(request, prepared, generations, chat=chat)

    def _admit(self, body: bytes, chat: bool, arrived: float,
               tenant: str | None) -> tuple[_Prepared, list[ServedGeneration]]:
        prepared = self._prepare(body, chat, tenant)
        return prepared, self._start(prepared, arrived)

    async def tokenize(self, request: HttpRequest) -> Response:
        raw = await self._body(request)
        answer = await run_in_threadpool(
            lambda: encode_json(tokenize(decode_body(raw), self.prompts, self._check_model)))
        return Response(answer, media_type="application/json")

    async def detokenize(self, request: HttpRequest) -> Response:
        raw = await self._body(request)
        answer = await run_in_threadpool(
            lambda: encode_json(detokenize(decode_body(raw), self.tokenizer,
                                           self._check_model)))
        return Response(answer, media_type="application/json")

    async def models(self, request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self._created,
             "owned_by": "onnx-chunk", "max_model_len": self.capacity}]})

    async def health(self, request: HttpRequest) -> Response:
        if self.draining or self.runtime.closed:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_page(self, request: HttpRequest) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def _body(self, request: HttpRequest) -> bytes:
        """The request's body, read up to `max_body_bytes` (413 beyond)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large(f"{int(declared)} bytes", limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(f"more than {limit} bytes", limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def _prepare(self, body: bytes, chat: bool, tenant: str | None = None) -> _Prepared:
        """Parse, check and encode one request and build its sampling (on a worker thread:
        this is the work whose size the client chooses, the grammar's compilation included);
        every refusal raised before any generation."""
        vocab_size = self.vocab_size
        request: ChatCompletionRequest | CompletionRequest
        if chat:
            request = ChatCompletionRequest.parse(decode_body(body), vocab_size=vocab_size)
        else:
            request = CompletionRequest.parse(decode_body(body), vocab_size=vocab_size)
        options = request.options
        if self.draining:
            raise ClosedError("the server is shutting down")
        self._check_model(options.model)
        tokenizer = self.tokenizer
        if options.constrained:
            from onnx_chunk.structured import prepare

            prepare(tokenizer)
        texts: tuple[str | tuple[int, ...], ...] = ()
        if isinstance(request, ChatCompletionRequest):
            prompts = [chat_ids(request, self.prompts, self.capacity)]
        else:
            texts = request.prompts()
            prompts = completion_ids(request, self.prompts, self.capacity)
        # Before the grammar is compiled and anything queued: the answer's least size.
        request.answer_floor([len(ids) for ids in prompts], self.capacity).check(
            self.max_answer_bytes)
        ends = options.end_ids(tokenizer.eos_token_ids or self.eos_token_ids)
        sampling = request.sampling(search=self.search, tokenizer=tokenizer,
                                    vocab_size=vocab_size, ends=ends,
                                    cache_salt=self._salt(options, tenant))
        if options.max_tokens == 0 and sampling.prompt_logprobs is None:
            # An echo of 0 new tokens without logprobs: the engine still runs the prompt once
            # (a request that generates nothing is one that scores its prompt).
            sampling = dataclasses.replace(sampling, prompt_logprobs=0)
        text_options = {
            "skip_special_tokens": options.skip_special_tokens,
            "spaces_between_special_tokens": options.spaces_between_special_tokens,
            "include_stop_str_in_output": options.include_stop_str_in_output}
        return _Prepared(options, texts, prompts, text_options, sampling, ends)

    def _salt(self, options: RequestOptions, tenant: str | None) -> str | None:
        """The prefix namespace of a request: its key's (unless keys share prefixes) and its
        `cache_salt`; a namespace of its own with `cache_prompt: false` (a fresh prefill)."""
        if not options.cache_prompt:
            return f"fresh:{uuid.uuid4().hex}"
        parts = [] if tenant is None or self.share_prefixes else [f"key:{tenant}"]
        if options.cache_salt is not None:
            parts.append(f"salt:{options.cache_salt}")
        return "\x00".join(parts) or None

    async def _serve(self, request: HttpRequest, prepared: _Prepared,
                     generations: list[ServedGeneration], *, chat: bool) -> _Reply:
        options = prepared.options
        top = options.logprobs
        shown = {"prompt_top": options.prompt_logprobs, "request_id": options.request_id,
                 "names": self.token_ids if options.return_tokens_as_token_ids else None,
                 "continuous_usage": options.continuous_usage}
        answer: Answer = (ChatAnswer(self.model_name, self.strings, top, options.tool_choice,
                                     **shown)
                          if chat else
                          TextAnswer(self.model_name, self.strings, top,
                                     self._echoes(prepared) if options.echo else None,
                                     options.n, **shown))
        self._live.update(generations)
        if self.draining:  # drain() ran while the request was admitted off the loop
            for generation in generations:
                generation.end_for_shutdown()
        if options.stream:
            return EventStream(self._events(generations, answer, options.include_usage,
                                             options.n),
                                lambda: self._ended(generations))
        try:
            outputs = await unless_disconnected(
                asyncio.gather(*(collect_chunks(generation) for generation in generations)),
                request.receive)
        finally:
            self._ended(generations)
        if outputs is None:
            return Response(status_code=499)
        # Off the loop: an answer with logprobs (an echoed prompt's above all) grows with the
        # request, and so does its JSON.
        payload = await run_in_threadpool(self.whole_json, answer, generations, outputs, options.n)
        return Response(payload, media_type="application/json")

    def whole_json(self, answer: Answer, generations: list[ServedGeneration],
                   outputs: list[tuple[str, list[TokenLogprobs]]], n: int) -> bytes:
        """A whole answer's JSON (refused past `max_answer_bytes`)."""
        # Each choice encoded alone: the encoder holds the GIL while it runs, so the event
        # loop waits for at most one choice's encoding, never the whole answer's.
        head, tail = encode_json(answer.whole([], usage(generations, n), generations)).split(
            b'"choices":[]', 1)
        parts, size = [head, b'"choices":['], len(head) + len(tail)
        for number, (generation, (text, entries)) in enumerate(zip(generations, outputs)):
            choice = encode_json(answer.choice(generation, text, entries))
            size += len(choice) + 1
            if size > self.max_answer_bytes:
                break
            parts += [b"," if number else b"", choice]
        if size > self.max_answer_bytes:
            raise answer_too_large(f"at least {size} bytes", self.max_answer_bytes)
        return b"".join([*parts, b"]", tail])

    def _echoes(self, prepared: _Prepared) -> list[str]:
        """Each prompt's text as `echo` shows it (token-id prompts, and prompts cut by
        `truncate_prompt_tokens`, decoded: what was fed)."""
        cut = prepared.options.truncate_prompt_tokens is not None
        return [prompt if isinstance(prompt, str) and not cut else self.tokenizer.decode(ids)
                for prompt, ids in zip(prepared.texts, prepared.prompts)]

    def _check_model(self, model: object) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(f"the model {model!r} is not served here; this server serves "
                               f"{self.model_name!r} (GET /v1/models)", param="model",
                               code="model_not_found", status=404)

    def _ended(self, generations: list[ServedGeneration]) -> None:
        for generation in generations:
            generation.close()
            self._live.discard(generation)

    def _start(self, prepared: _Prepared, arrived: float) -> list[ServedGeneration]:
        """Submit every choice of a prepared request: `n` per prompt, prefilled once
        (`Runtime.submit_choices`), choice i of a seeded request with seed + i (every refusal
        raised before any work; a refusal of a later prompt cancels the earlier ones). Only
        the first prompt may find the queue full (429): the later ones wait for room (on this
        worker thread), since the first prompt's forks may fill the queue past its limit."""
        if self.draining:
            raise ClosedError("the server is shutting down")
        options, sampling = prepared.options, prepared.sampling
        capacity = self.capacity
        for ids in prepared.prompts:
            check_room(len(ids), capacity, options)
        generations: list[ServedGeneration] = []
        try:
            for number, ids in enumerate(prepared.prompts):
                samplings = [sampling.for_choice(choice) for choice in range(options.n)]
                room = capacity - len(ids)
                requests = self.runtime.submit_choices(
                    ids, room if options.max_tokens is None else options.max_tokens, samplings,
                    eos_token_id=prepared.ends, wait=number > 0)
                for choice, request in enumerate(requests):
                    text = TokenText(self.tokenizer, options.stop, ends_at=request.ends_at,
                                     min_tokens=options.min_tokens, **prepared.text_options)
                    generations.append(ServedGeneration(request, text, len(ids), arrived,
                                                        self.metrics, number * options.n + choice))
        except BaseException:
            for generation in generations:
                generation.request.cancel()
            raise
        return generations

    async def _events(self, generations: list[ServedGeneration], answer: Answer,
                      include_usage: bool, n: int) -> AsyncGenerator[bytes, None]:
        """The event stream: the choices one after the other (all run at once in the engine),
        each opened, streamed and closed with its index."""
        generation = generations[0]
        sent = 0
        try:
            for generation in generations:
                async with contextlib.aclosing(answer.events(generation)) as events:
                    async for written in events:
                        sent += len(written)
                        if sent > self.max_answer_bytes:
                            raise answer_too_large(f"at least {sent} bytes",
                                                    self.max_answer_bytes)
                        yield written
            if include_usage:
                yield event(answer.usage_chunk(usage(generations, n)))
            yield b"data: [DONE]\n\n"
        except RequestError as error:
            yield event(error_body(str(error), error.error_type, param=error.param,
                                   code=error.code))
        except ClosedError as error:
            yield event(error_body(str(error), "server_error", code="server_shutting_down"))
        except OnnxChunkError as error:
            logger.warning("request %d failed: %s", generation.request.id, error)
            yield event(error_body(str(error), "server_error", code="generation_failed"))
        except Exception:
            logger.exception("request %d failed", generation.request.id)
            yield event(error_body("the server failed this request (logged on the server)",
                                   "server_error", code="internal_error"))

    def _authorize(self, request: HttpRequest) -> str | None:
        """The request's tenant: the number of the key it sent (None: the app has no key)."""
        if not self.api_keys:
            return None
        given = request.headers.get("authorization", "").encode()
        # Every key is compared (in constant time), so the time does not tell which matched.
        matched = [hmac.compare_digest(given, f"Bearer {key}".encode())
                   for key in self.api_keys]
        if not any(matched):
            raise RequestError("missing or wrong API key: send 'Authorization: Bearer KEY' "
                               "with a key the server was started with",
                               code="invalid_api_key", status=401)
        return str(matched.index(True))

    def _error_response(self, error: Exception) -> Response:
        status, body, headers = error_answer(error)
        self.metrics.rejected.labels(status=str(status)).inc()
        return JSONResponse(body, status_code=status, headers=headers)


# What an endpoint replies: a whole response, or a stream of events.
_Reply = Response | EventStream
