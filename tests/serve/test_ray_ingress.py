"""The Ray ingress on its own (no Ray running): what it forwards, and a replica's failure as an
OpenAI-shaped 500 with no traceback."""

from __future__ import annotations

import json

import pytest

from tests.serve.conftest import EXPORT

pytest.importorskip("ray", reason="ray is not installed (pip install 'onnx-chunk[ray]')")

from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from onnx_chunk.serve.ray import Head, Ingress  # noqa: E402
from onnx_chunk.serve.routing import prefix_blocks, request_key  # noqa: E402
from onnx_chunk.text.prompt import PromptEncoder  # noqa: E402
from onnx_chunk.text.tokenizer import load_tokenizer  # noqa: E402


class _Answer:
    def __init__(self, items):
        self._items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._items:
            raise StopAsyncIteration
        item = self._items.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class _Handle:
    """A deployment handle that records calls and answers with the given items."""

    def __init__(self, items):
        self.items = items
        self.calls = []
        self.answers = []

    def options(self, **options):
        assert options == {"stream": True}
        return self

    def remote(self, call, prefix):
        self.calls.append((call, prefix))
        self.answers.append(_Answer(self.items))
        return self.answers[-1]


def _client(handle, max_body_bytes=1 << 20):
    ingress = Ingress(handle, str(EXPORT), max_body_bytes)
    app = Starlette(routes=[Route("/{path:path}", ingress.__call__, methods=["GET", "POST"])])
    return TestClient(app)


def test_it_forwards_the_request_with_its_prefix_digests_and_streams_the_answer_back():
    handle = _Handle([Head(201, (("content-type", "application/json"),
                                  ("x-onnx-chunk-replica", "abc"))), b'{"a": ', b"1}"])
    body = {"messages": [{"role": "user", "content": "Tell me about the harbour lights."}]}
    answer = _client(handle).post("/v1/chat/completions?x=1", json=body)
    assert (answer.status_code, answer.json()) == (201, {"a": 1})
    assert answer.headers["x-onnx-chunk-replica"] == "abc"
    call, prefix = handle.calls[0]
    assert (call.method, call.path, call.query_string) == ("POST", "/v1/chat/completions",
                                                           b"x=1")
    assert json.loads(call.body) == body
    key = request_key(call.path, call.body,
                      PromptEncoder(load_tokenizer(EXPORT), special_in_content=False))
    assert key and prefix == prefix_blocks(key)


def test_a_body_over_the_limit_is_cut_one_byte_past_it_for_the_replica_to_refuse():
    handle = _Handle([Head(413, ()), b""])
    _client(handle, max_body_bytes=100).post("/v1/completions", content=b"x" * 5000)
    assert len(handle.calls[0][0].body) == 101


def test_a_replica_failure_is_an_openai_shaped_500_without_a_traceback():
    handle = _Handle([RuntimeError("Traceback (most recent call last): secret")])
    answer = _client(handle).post("/v1/completions", json={"prompt": "hi"})
    assert answer.status_code == 500
    assert answer.json()["error"]["code"] == "internal_error"
    assert "secret" not in answer.text and "Traceback" not in answer.text
    assert handle.answers[0].cancelled


@pytest.mark.parametrize("options, named", [({"routing": "random"}, "routing"),
                                            ({"max_excess": -1}, "max_excess"),
                                            ({"memory": 0}, "memory"),
                                            ({"replicas": 0}, "replicas")])
def test_application_refuses_bad_options_before_ray_starts(options, named):
    from onnx_chunk.errors import ConfigError
    from onnx_chunk.serve.ray import application

    with pytest.raises(ConfigError, match=named):
        application(EXPORT, **options)



def test_a_replica_lost_mid_stream_ends_the_stream_with_an_error_event():
    handle = _Handle([Head(200, (("content-type", "text/event-stream; charset=utf-8"),)),
                      b'data: {"choices": []}\n\n', RuntimeError("the actor died")])
    answer = _client(handle).post("/v1/completions", json={"prompt": "hi", "stream": True})
    events = [event for event in answer.text.split("\n\n") if event]
    assert events[0] == 'data: {"choices": []}'
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == "replica_lost" and "actor died" not in answer.text
    assert handle.answers[0].cancelled


def test_a_replica_shutting_down_drains_its_streams_then_closes_the_runtime():
    """The replica's shutdown hook (`Replica.__del__`, which Ray Serve awaits) runs the server's
    drain: a running stream ends with the `server_shutting_down` error event, then the runtime
    closes."""
    import asyncio

    from onnx_chunk.runtime import load
    from onnx_chunk.serve import create_app
    from onnx_chunk.serve.ray import drain_and_close

    async def scenario(app, runtime) -> list[bytes]:
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 1900,
                           "ignore_eos": True, "stream": True}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions",
                 "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
                 "headers": [(b"content-type", b"application/json")], "client": None,
                 "server": None}
        received = [{"type": "http.request", "body": body, "more_body": False}]
        left = asyncio.Event()
        sent: asyncio.Queue = asyncio.Queue()

        async def receive():
            if received:
                return received.pop()
            await left.wait()
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(app(scope, receive, sent.put))
        chunks: list[bytes] = []
        while not chunks:
            message = await sent.get()
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
        await drain_and_close(app, runtime)
        while not task.done() or not sent.empty():
            message = await asyncio.wait_for(sent.get(), 30)
            if message.get("body"):
                chunks.append(message["body"])
            if message["type"] == "http.response.body" and not message.get("more_body"):
                break
        left.set()
        await task
        return chunks

    runtime = load(EXPORT, provider="cpu", max_batch=2)
    app = create_app(runtime)
    events = [line for chunk in asyncio.run(scenario(app, runtime))
              for line in chunk.decode().split("\n\n") if line]
    assert events[-1] != "data: [DONE]"
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == \
        "server_shutting_down"
    assert runtime.closed and app.state.service.running == 0
