"""Speculative decoding over HTTP: a server loaded with speculative="prompt-lookup" answers
what a plain one answers (greedy), and /metrics counts the drafted and accepted tokens."""

from __future__ import annotations

import http.client

from onnx_chunk.runtime import load
from tests.serve.conftest import EXPORT, exchange, live_server

PROMPT = "one two three one two three one two three one two"


def _completion(live) -> str:
    status, _, body = exchange(live, "POST", "/v1/completions", {
        "model": EXPORT.name, "prompt": PROMPT, "max_tokens": 48, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


def test_a_speculative_server_answers_as_a_plain_one_and_counts_drafts():
    with load(EXPORT, provider="cpu", max_batch=2) as plain, live_server(plain) as live:
        expected = _completion(live)
    with load(EXPORT, provider="cpu", max_batch=2, speculative="prompt-lookup") as runtime, \
            live_server(runtime) as live:
        assert _completion(live) == expected
        engine = runtime.stats.engine
        assert engine.draft_tokens > 0 and engine.accepted_tokens <= engine.draft_tokens
        connection = http.client.HTTPConnection(live.url.removeprefix("http://"), timeout=60)
        connection.request("GET", "/metrics")
        metrics = connection.getresponse().read().decode()
        connection.close()
        assert f"onnx_chunk_draft_tokens_total {float(engine.draft_tokens)}" in metrics
