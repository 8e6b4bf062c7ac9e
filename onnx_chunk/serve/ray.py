"""Ray Serve: the server as N replicas, each its own process with its own runtime, and requests
routed to the replica that holds their prompt's prefix.

Two deployments. The replicas (`name`): each loads the model once (its weights, its batch
engine, its variant cache: nothing is shared between replicas, so every replica warms its own
ladder) and runs the same app as `onnx-chunk serve`. The ingress (`name`-ingress, one light
process, no model): it reads a request, computes its prompt key (`routing.request_key`: the
chat rendered through the model's template, or the completion's prompt) and its block digests,
and hands the request to the replicas through a deployment handle, whose request router picks
the replica: `PrefixAffinityRouter` (`routing="prefix"`, `routing.PrefixAffinity`'s rule) or
Ray's default power of two choices (`routing="power-of-two"`). The answer (streamed or not)
comes back through the ingress unchanged, with the header `x-onnx-chunk-replica` naming the
replica that served it. Give each replica one GPU (`gpus_per_replica=1`: Ray sets
CUDA_VISIBLE_DEVICES, so every replica sees its GPU as device 0) or, on CPU, the cores of one
socket (`cpus_per_replica`, with `intra_op_threads` to match). Needs the `ray` extra
(`pip install 'onnx-chunk[ray]'`).

    from ray import serve
    from onnx_chunk.serve.ray import application
    serve.run(application("path/to/model", replicas=2, gpus_per_replica=1), route_prefix="/")
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from onnx_chunk.errors import ConfigError
from onnx_chunk.serve.app import DEFAULT_MAX_BODY_BYTES
from onnx_chunk.serve.protocol import error_body
from onnx_chunk.serve.routing import (
    BLOCK_CHARS,
    MAX_KEY_CHARS,
    InFlight,
    PrefixAffinity,
    prefix_blocks,
    request_key,
)

if TYPE_CHECKING:
    from onnx_chunk.text.prompt import PromptEncoder

logger = logging.getLogger(__name__)

ROUTINGS = ("prefix", "power-of-two")
# The response header naming the replica that served a request.
REPLICA_HEADER = "x-onnx-chunk-replica"
# The prompts the router remembers per engine slot of a replica by default: more than the slots
# keep, so that a conversation whose prefix was evicted still returns to its replica and each
# replica's slots are shared by its own conversations only (see scripts/simulate_routing.py).
MEMORY_PER_SLOT = 8
# Seconds the router waits for a replica's queue length it has not cached.
_PROBE_DEADLINE_S = 1.0
# Seconds a replica shutting down waits for its drained streams to send their last event.
DRAIN_WAIT_S = 5.0


def application(model: str | os.PathLike, *, replicas: int = 1, gpus_per_replica: float = 0,
                cpus_per_replica: float = 1, provider: str = "auto", batch: int = 4,
                queue: int = 64, capacity: int | None = None,
                intra_op_threads: int | None = None, api_key: str | None = None,
                max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                parse_special_in_content: bool = False,
                trust_request_chat_template: bool = False, name: str = "onnx-chunk",
                routing: str = "prefix", max_excess: int | None = None,
                memory: int | None = None, graceful_shutdown_s: float = 20.0) -> Any:
    """A Ray Serve application of `replicas` replicas of the server on `model` behind one
    ingress (bind()ed; pass it to `serve.run`). Every option but the Ray resources and the
    routing is `load`'s or the server's.

    routing: "prefix" (affinity with a load guard) or "power-of-two" (Ray's default router).
    max_excess: the requests a replica may hold beyond the least loaded one and still get the
        prompts whose prefix it holds (default: `batch`, one batch more).
    memory: the prompts the router remembers per replica (default: `MEMORY_PER_SLOT` per
        slot of its engine; see docs/serving.md, "Routing by prefix").
    graceful_shutdown_s: how long a replica shutting down waits for its running requests
        (Ray's graceful_shutdown_timeout_s; its default).
    A replica holds at most `batch + queue` requests (Ray's max_ongoing_requests), as the
    engine does.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"replicas must be an integer >= 1, got {replicas!r}")
    if routing not in ROUTINGS:
        raise ConfigError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    model_path = os.fspath(model)
    load_options = {"provider": provider, "max_batch": batch, "max_queue": queue,
                    "capacity": capacity, "intra_op_threads": intra_op_threads}
    app_options = {"api_key": api_key, "max_body_bytes": max_body_bytes,
                   "parse_special_in_content": parse_special_in_content,
                   "trust_request_chat_template": trust_request_chat_template}
    deployment_options: dict[str, Any] = {
        "name": name, "num_replicas": replicas, "max_ongoing_requests": batch + queue,
        "graceful_shutdown_timeout_s": graceful_shutdown_s,
        "ray_actor_options": {"num_gpus": gpus_per_replica, "num_cpus": cpus_per_replica}}
    if routing == "prefix":
        rule = {"memory": MEMORY_PER_SLOT * batch if memory is None else memory,
                "max_excess": batch if max_excess is None else max_excess}
        # Its options checked here, before Ray starts anything.
        PrefixAffinity(memory=rule["memory"], max_excess=rule["max_excess"])
        deployment_options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter, request_router_kwargs=rule)
    engines = serve.deployment(**deployment_options)(Replica).bind(
        model_path, load_options, app_options)
    ingress = serve.deployment(name=f"{name}-ingress",
                               max_ongoing_requests=replicas * (batch + queue),
                               ray_actor_options={"num_cpus": 0})(Ingress)
    return ingress.bind(engines, model_path, max_body_bytes, parse_special_in_content,
                        trust_request_chat_template)


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve's request router (the custom request router API, alpha in ray 2.60) running
    `routing.PrefixAffinity`: the replica that holds the deepest prefix of the request's prompt
    unless it holds `max_excess` requests more than the least loaded candidate, else power of
    two choices. A replica's load is its queue length as Ray counts it (requests sent to it and
    not finished), from Ray's cache or probed, plus the requests this router chose for it that
    Ray has not sent yet (`InFlight`). The request's block digests come from the
    ingress (the `prefix` keyword of the call); a routed request is recorded on its replica."""

    def initialize_state(self, memory: int, max_excess: int) -> None:
        self._rule: PrefixAffinity[ReplicaID] = PrefixAffinity(memory=memory,
                                                               max_excess=max_excess)
        self._rng = random.Random()
        self._in_flight: InFlight[ReplicaID] = InFlight()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        loads = await self._loads(candidate_replicas)
        if not loads:  # no replica answered: let Ray probe two at random
            return [self._rng.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        now = time.monotonic()
        for replica_id, count in self._in_flight.counts(now).items():
            if replica_id in loads:
                loads[replica_id] += count
        choice = self._rule.choose(_blocks(pending_request), loads)
        if pending_request is not None:
            self._in_flight.add(pending_request.metadata.internal_request_id, choice.replica,
                                now)
        others = [replica for replica in candidate_replicas
                  if replica.replica_id != choice.replica]
        ranks = [[by_id[choice.replica]]]
        if others:  # if the chosen one turns the request away (full), two others
            ranks.append(self._rng.sample(others, min(2, len(others))))
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        self._in_flight.confirm(pending_request.metadata.internal_request_id)
        self._rule.record(replica_id, _blocks(pending_request))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self.curr_replicas) - {replica.replica_id for replica in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self._rule.forget(replica_id)

    async def _loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Each replica's queue length: cached by Ray, or asked (those that do not answer
        within the deadline are left out)."""
        cache = self.replica_queue_len_cache
        loads: dict[ReplicaID, int] = {}
        unknown = []
        for replica in replicas:
            length = cache.get(replica.replica_id)
            if length is None:
                unknown.append(replica)
            else:
                loads[replica.replica_id] = length
        answers = await asyncio.gather(
            *(replica.get_queue_len(deadline_s=_PROBE_DEADLINE_S) for replica in unknown),
            return_exceptions=True)
        for replica, answer in zip(unknown, answers):
            if isinstance(answer, int):
                cache.update(replica.replica_id, answer)
                loads[replica.replica_id] = answer
        return loads


def _blocks(pending_request: PendingRequest | None) -> tuple[Hashable, ...]:
    if pending_request is None:
        return ()
    return tuple(pending_request.kwargs.get("prefix", ()))


@dataclass(frozen=True)
class Call:
    """An HTTP request as the ingress forwards it to a replica."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None


@dataclass(frozen=True)
class Head:
    """The status and headers of a replica's answer (its body follows as bytes)."""

    status: int
    headers: tuple[tuple[str, str], ...]


class Replica:
    """One replica: its own runtime and the server's app, called with forwarded requests."""

    def __init__(self, model_path: str, load_options: dict[str, Any],
                 app_options: dict[str, Any]) -> None:
        from onnx_chunk.runtime import load
        from onnx_chunk.serve import create_app

        self._runtime = load(model_path, **load_options)
        self._app = create_app(self._runtime, **app_options)
        self._name = serve.get_replica_context().replica_id.unique_id

    async def __call__(self, call: Call, prefix: tuple[Hashable, ...] = ()
                       ) -> AsyncIterator[Head | bytes]:
        """The app's answer to `call`: a `Head`, then the body's pieces (`prefix` is the
        router's: the request's block digests)."""
        async for item in _asgi_answer(self._app, call, (REPLICA_HEADER, self._name)):
            yield item

    def __del__(self) -> Awaitable[None] | None:
        """Ray Serve's shutdown hook, which awaits what it returns: the server's drain (as
        SIGTERM runs it for `onnx-chunk serve`), then the runtime closed. Called by the garbage
        collector instead (no event loop running), it closes the runtime."""
        runtime = getattr(self, "_runtime", None)
        if runtime is None or runtime.closed:
            return None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            runtime.close()
            return None
        return drain_and_close(self._app, runtime)


async def drain_and_close(app: Any, runtime: Any, wait_s: float = DRAIN_WAIT_S) -> None:
    """Drain the server's `app` (no request admitted, running ones ended: a stream gets the
    `server_shutting_down` error event), wait up to `wait_s` seconds for its streams to send
    their last event, then close `runtime`."""
    service = app.state.service
    service.drain()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while service.running and loop.time() < deadline:
        await asyncio.sleep(0.01)
    runtime.close()


async def _asgi_answer(app: Any, call: Call, extra_header: tuple[str, str]
                       ) -> AsyncIterator[Head | bytes]:
    """Run the ASGI `app` on one request in this process; its answer as a `Head` then body
    pieces. Closing the iterator early is the client leaving: the app sees a disconnect."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": call.method, "scheme": "http", "path": call.path, "raw_path":
             call.path.encode(), "root_path": "", "query_string": call.query_string,
             "headers": list(call.headers), "client": call.client, "server": None}
    sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    left = asyncio.Event()
    body = [{"type": "http.request", "body": call.body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if body:
            return body.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, receive, sent.put))
    try:
        while True:
            message = await _next_message(sent, task)
            if message["type"] == "http.response.start":
                headers = [(key.decode("latin-1"), value.decode("latin-1"))
                           for key, value in message.get("headers", ())]
                yield Head(message["status"], (*headers, extra_header))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        await task
    finally:
        left.set()
        if not task.done():
            task.cancel()


async def _next_message(sent: asyncio.Queue, task: asyncio.Future) -> dict[str, Any]:
    """The app's next message; the app's own failure if it ends without answering."""
    getter = asyncio.ensure_future(sent.get())
    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    task.result()
    raise RuntimeError("the app ended without finishing its answer")


class Ingress:
    """The front: reads a request, computes its prompt's block digests, forwards it to the
    replicas' handle (whose router picks the replica) and streams the answer back."""

    def __init__(self, engines: Any, model_path: str, max_body_bytes: int,
                 parse_special_in_content: bool = False,
                 trust_request_chat_template: bool = False) -> None:
        from onnx_chunk.text.prompt import PromptEncoder
        from onnx_chunk.text.tokenizer import load_tokenizer

        self._engines = engines.options(stream=True)
        self._max_body_bytes = max_body_bytes
        # The replicas' encoder (their special-token policy), to render what they render.
        self._prompts: PromptEncoder | None
        try:
            self._prompts = PromptEncoder(load_tokenizer(model_path),
                                          special_in_content=parse_special_in_content,
                                          request_templates=trust_request_chat_template)
        except Exception as error:  # the replicas report a bad folder; chats lose affinity
            logger.warning("no tokenizer for the routing keys (%s): chats are routed by load",
                           error)
            self._prompts = None

    async def __call__(self, request: Any) -> Any:
        from starlette.concurrency import run_in_threadpool
        from starlette.requests import ClientDisconnect
        from starlette.responses import JSONResponse, Response, StreamingResponse

        try:
            body = await self._body(request)
        except ClientDisconnect:  # nobody is left to answer; not the server's failure
            logger.info("a client left during its upload to %s", request.url.path)
            return Response(status_code=499)
        prefix = await run_in_threadpool(self._prefix, request.url.path, body)
        client = tuple(request.client) if request.client else None
        call = Call(request.method, request.url.path, request.url.query.encode(),
                     tuple(request.headers.raw), body, client)
        answer = self._engines.remote(call, prefix=prefix)
        try:
            head = await answer.__anext__()
        except Exception as error:  # a replica that failed or died: the server's fault
            logger.error("no answer from a replica for %s", request.url.path, exc_info=error)
            answer.cancel()
            return JSONResponse(error_body("the server failed this request (logged on the "
                                           "server)", "server_error", code="internal_error"),
                                status_code=500)
        headers = {key: value for key, value in head.headers
                   if key.lower() not in ("content-length", "transfer-encoding")}
        events = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_rest(answer, events), status_code=head.status,
                                 headers=headers)

    async def _body(self, request: Any) -> bytes:
        """The body, read up to one byte past the limit: the replica refuses it (413) with
        its own message; the ingress never holds more."""
        chunks, size = [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > self._max_body_bytes:
                break
        return b"".join(chunks)[:self._max_body_bytes + 1]

    def _prefix(self, path: str, body: bytes) -> tuple[bytes, ...]:
        return prefix_blocks(request_key(path, body, self._prompts, max_chars=MAX_KEY_CHARS),
                             BLOCK_CHARS)


async def _rest(answer: Any, events: bool = False) -> AsyncIterator[bytes]:
    """The body pieces of a replica's answer; the replica's call is cancelled if the client
    leaves first. A replica lost mid-answer (shut down, died) ends an event stream with an
    error event, as the server's own failures end one (a whole answer is cut short)."""
    finished = False
    try:
        try:
            async for piece in answer:
                yield piece
        except Exception as error:  # the replica is gone: the server's fault
            logger.error("the replica stopped in the middle of an answer", exc_info=error)
            if events:
                body = error_body("the replica serving this request stopped before it "
                                  "finished; retry", "server_error", code="replica_lost")
                yield f"data: {json.dumps(body)}\n\n".encode()
            return
        finished = True
    finally:
        if not finished:
            answer.cancel()
