"""A live server on loopback for the serve tests: the app on a real export, under uvicorn in a
thread, on a free port; stopped (drained) by the fixture."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from starlette.applications import Starlette

from onnx_chunk.runtime import Runtime, load
from onnx_chunk.serve import create_app
from onnx_chunk.serve.server import DrainingServer, bind
from tests.exports.corpus import ROOT

# A real builder export with a tokenizer and a chat template.
EXPORT = ROOT / "genai-qwen3-fp32"
MODEL_NAME = EXPORT.name


@dataclass
class LiveServer:
    url: str
    server: DrainingServer
    runtime: Runtime
    app: Starlette

    def client(self, api_key: str = "unused"):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             timeout=60)


@contextmanager
def live_server(runtime: Runtime, **app_options) -> Iterator[LiveServer]:
    """`runtime` served on 127.0.0.1 at a free port until the block ends."""
    listener = bind("127.0.0.1", 0)
    app = create_app(runtime, **app_options)
    server = DrainingServer(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield LiveServer(f"http://127.0.0.1:{listener.getsockname()[1]}", server, runtime,
                         app)
    finally:
        server.stop()
        thread.join(30)
        listener.close()


def exchange(live: LiveServer, method: str, path: str, body: bytes | dict | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], object]:
    """One plain HTTP exchange: (status, the headers the test asks about, the JSON body)."""
    connection = http.client.HTTPConnection(live.url.removeprefix("http://"), timeout=60)
    payload = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        connection.request(method, path, body=payload, headers=headers or {})
        response = connection.getresponse()
        data = json.loads(response.read())
        kept = {name: response.headers[name] for name in ("Retry-After",)
                if response.headers.get(name) is not None}
        return response.status, kept, data
    finally:
        connection.close()


def wait_for(condition, timeout: float = 5.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture(scope="package")
def served_runtime():
    with load(EXPORT, provider="cpu", max_batch=2) as runtime:
        yield runtime


@pytest.fixture(scope="package")
def live(served_runtime):
    with live_server(served_runtime) as running:
        yield running


@pytest.fixture(scope="package")
def trusting(served_runtime):
    """A server that renders a request's own chat_template (--trust-request-chat-template)."""
    with live_server(served_runtime, trust_request_chat_template=True) as running:
        yield running
