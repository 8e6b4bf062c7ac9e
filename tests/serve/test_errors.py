"""Every refusal of the server, in OpenAI's error shape; disconnects free their slots."""

from __future__ import annotations

import http.client
import json
import logging
import socket

import openai
import pytest

from onnx_chunk.runtime import load
from onnx_chunk.text.tokenizer import tokenizer_of
from tests.serve.conftest import EXPORT, MODEL_NAME, exchange, live_server, wait_for

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
# Greedy on this export, this prompt runs 2,000 tokens without an EOS: a request that lasts.
LONG_PROMPT = "The capital of France is"
LONG_TOKENS = 1900


def _error(body: object, status: int, param: str | None = None) -> dict:
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    assert "Traceback" not in error["message"]
    return error


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, b"{not json", None),
    (CHAT, b"\xff\xfe", None),
    (CHAT, b"[1, 2]", None),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "max_tokens": "8"}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": 2.5}, "max_completion_tokens"),
    (CHAT, {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": MESSAGES, "temperature": 3}, "temperature"),
    (CHAT, {"messages": MESSAGES, "top_p": 0}, "top_p"),
    (CHAT, {"messages": MESSAGES, "seed": 2 ** 63}, "seed"),
    (CHAT, {"messages": MESSAGES, "n": 17}, "n"),
    (CHAT, {"messages": MESSAGES, "n": 0}, "n"),
    (CHAT, {"messages": MESSAGES, "stream": "yes"}, "stream"),
    (CHAT, {"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (CHAT, {"messages": MESSAGES, "stop": [""]}, "stop"),
    (CHAT, {"messages": MESSAGES, "logprobs": 2}, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": True}, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": 12}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", 2]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, -2]}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "best_of": 3}, "best_of"),
])
def test_a_bad_body_is_a_400_in_openais_shape(live, path, body, param):
    status, _, answer = exchange(live, "POST", path, body)
    assert status == 400
    assert _error(answer, 400, param)["type"] == "invalid_request_error"


def test_the_client_sees_a_bad_request_error(live):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        live.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                              max_tokens=-3)


def test_token_ids_outside_the_vocabulary_are_a_400(live):
    vocab = live.runtime.stats.vocab_size
    status, _, answer = exchange(live, "POST", COMPLETIONS, {"prompt": [1, vocab]})
    message = _error(answer, 400, "prompt")["message"]
    assert status == 400 and str(vocab) in message and "position 1" in message
    # Which prompt of several, and an id past any integer type: the same refusal.
    status, _, answer = exchange(live, "POST", COMPLETIONS, {"prompt": [[1], [2, 10 ** 30]]})
    message = _error(answer, 400, "prompt")["message"]
    assert status == 400 and "prompt 1's id at position 1 is" in message


def test_a_prompt_over_the_context_is_a_400_with_the_numbers(live):
    capacity = live.runtime.stats.capacity
    status, _, answer = exchange(live, "POST", COMPLETIONS,
                                 {"prompt": [5] * (capacity + 3), "max_tokens": 4})
    error = _error(answer, 400, "prompt")
    assert status == 400 and error["code"] == "context_length_exceeded"
    assert str(capacity + 3) in error["message"] and str(capacity) in error["message"]
    status, _, answer = exchange(live, "POST", COMPLETIONS, {"prompt": [5] * capacity})
    assert status == 400 and str(capacity) in _error(answer, 400, "prompt")["message"]
    status, _, answer = exchange(live, "POST", CHAT, {"messages": MESSAGES,
                                                      "max_tokens": capacity})
    error = _error(answer, 400, "messages")
    assert status == 400 and error["code"] == "context_length_exceeded"
    assert str(capacity) in error["message"]


def test_an_unknown_model_route_or_method_is_a_404_or_405_in_shape(live):
    status, _, answer = exchange(live, "POST", CHAT, {"model": "gpt-x", "messages": MESSAGES})
    assert status == 404 and _error(answer, 404, "model")["code"] == "model_not_found"
    status, _, answer = exchange(live, "GET", "/v1/nothing")
    assert status == 404 and _error(answer, 404)
    status, _, answer = exchange(live, "GET", CHAT)
    assert status == 405 and _error(answer, 405)


def test_a_defect_is_a_500_in_shape_logged_on_the_server(live, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("a defect in the engine")

    monkeypatch.setattr(live.runtime, "submit", broken)
    with caplog.at_level(logging.ERROR, logger="onnx_chunk.serve.app"):
        status, _, answer = exchange(live, "POST", CHAT, {"messages": MESSAGES})
    error = _error(answer, 500)
    assert status == 500 and error["type"] == "server_error"
    assert "defect" not in error["message"]
    assert any("a defect in the engine" in str(record.exc_info[1]) for record in caplog.records
               if record.exc_info)


def test_a_full_queue_is_a_429_with_retry_after():
    with load(EXPORT, provider="cpu", max_batch=1, max_queue=1) as runtime, \
            live_server(runtime) as live:
        ids = tokenizer_of(runtime).encode(LONG_PROMPT)
        running = runtime.submit(ids, LONG_TOKENS, eos_token_id=[])
        wait_for(lambda: runtime.stats.engine.running == 1, what="the first slot")
        queued = runtime.submit(ids, LONG_TOKENS, eos_token_id=[])
        try:
            status, headers, answer = exchange(live, "POST", CHAT, {"messages": MESSAGES})
            assert status == 429 and int(headers["Retry-After"]) >= 1
            assert _error(answer, 429)["code"] == "queue_full"
            with pytest.raises(openai.RateLimitError):
                live.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        finally:
            running.cancel()
            queued.cancel()


def test_an_api_key_is_required_when_set(served_runtime):
    with live_server(served_runtime, api_key="s3cret") as live:
        status, _, answer = exchange(live, "POST", CHAT, {"messages": MESSAGES})
        assert status == 401 and _error(answer, 401)["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            live.client("wrong").models.list()
        assert live.client("s3cret").models.list().data[0].id == MODEL_NAME
        assert exchange(live, "GET", "/health")[0] == 200


def _cancelled(runtime) -> int:
    return runtime.stats.engine.cancelled


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_disconnects_cancels_its_request_and_frees_its_slot(live, stream):
    runtime = live.runtime
    ids = tokenizer_of(runtime).encode(LONG_PROMPT)
    exchange(live, "POST", COMPLETIONS, {"prompt": ids, "max_tokens": 1})  # the engine is up
    before = _cancelled(runtime)
    connection = http.client.HTTPConnection(live.url.removeprefix("http://"), timeout=30)
    connection.request("POST", COMPLETIONS, body=json.dumps(
        {"prompt": ids, "max_tokens": LONG_TOKENS, "temperature": 0, "stream": stream}))
    wait_for(lambda: runtime.stats.engine.running == 1, what="the request's slot")
    if stream:
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    wait_for(lambda: runtime.stats.engine.running == 0, timeout=0.5, what="the freed slot")
    assert _cancelled(runtime) == before + 1


class _FailingRequest:
    """A submitted request whose forward fails after its first token (as Request reports it)."""

    id = -1
    finish_reason = "error"

    def __init__(self, token: int) -> None:
        self._token = token

    def watch(self, callback) -> None:
        callback()

    def ends_at(self, count: int) -> bool:
        return False

    def ready(self, seen: int):
        if seen == 0:
            return [self._token], [None], False
        raise RuntimeError("the forward failed: device lost")

    def cancel(self) -> None:
        pass


def test_a_forward_failing_mid_stream_is_an_error_event_logged_on_the_server(live, monkeypatch,
                                                                             caplog):
    token = tokenizer_of(live.runtime).encode("hello", add_special_tokens=False)[0]
    monkeypatch.setattr(live.runtime, "submit", lambda *args, **kwargs: _FailingRequest(token))
    with caplog.at_level(logging.ERROR, logger="onnx_chunk.serve.app"):
        with pytest.raises(openai.APIError) as caught:
            for _ in live.client().completions.create(model=MODEL_NAME, prompt="hi",
                                                      max_tokens=4, stream=True):
                pass
    assert "device lost" not in str(caught.value)
    assert any("device lost" in str(record.exc_info[1]) for record in caplog.records
               if record.exc_info)
    status, _, answer = exchange(live, "POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 4})
    assert status == 500 and _error(answer, 500)["code"] == "internal_error"
