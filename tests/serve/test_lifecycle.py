"""Shutdown drains (streams end with an error event, exit 0); metrics count real events."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from onnx_chunk.text.tokenizer import tokenizer_of
from tests.serve.conftest import EXPORT, exchange, live_server, wait_for
from tests.serve.test_errors import COMPLETIONS, LONG_PROMPT, LONG_TOKENS


def _open_stream(address: str, ids: list[int]) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection(address, timeout=60)
    connection.request("POST", COMPLETIONS, body=json.dumps(
        {"prompt": ids, "max_tokens": LONG_TOKENS, "temperature": 0, "stream": True}))
    response = connection.getresponse()
    assert response.status == 200
    return response


def _events(response: http.client.HTTPResponse) -> list[object]:
    """The events after the first, up to the end of the stream."""
    events = []
    for line in response:
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip()
            events.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return events


def test_sigterm_ends_running_streams_with_an_error_event_and_exits_0():
    server = subprocess.Popen(
        [sys.executable, "-m", "onnx_chunk", "serve", str(EXPORT), "--provider", "cpu",
         "--port", "0", "--batch", "2"], stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()
        address = re.search(r"http://(\S+:\d+)", line).group(1)
        from onnx_chunk.runtime import load

        ids = tokenizer_of(load(EXPORT, provider="cpu")).encode(LONG_PROMPT)
        response = _open_stream(address, ids)
        assert response.readline().startswith(b"data: ")
        server.send_signal(signal.SIGTERM)
        events = _events(response)
        assert events and events[-1]["error"]["code"] == "server_shutting_down", events[-3:]
        assert "[DONE]" not in events
        assert server.wait(timeout=30) == 0
        rest = server.stderr.read()
        assert "Traceback" not in rest and "stopped" in rest
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_draining_server_ends_streams_and_refuses_new_requests_with_503(served_runtime):
    with live_server(served_runtime) as live:
        ids = tokenizer_of(served_runtime).encode(LONG_PROMPT)
        response = _open_stream(live.url.removeprefix("http://"), ids)
        assert response.readline().startswith(b"data: ")
        live.app.state.service.drain()
        assert _events(response)[-1]["error"]["code"] == "server_shutting_down"
        status, _, answer = exchange(live, "POST", COMPLETIONS, {"prompt": "hi"})
        assert status == 503 and answer["error"]["code"] == "server_shutting_down"
        assert exchange(live, "GET", "/health")[0] == 503
        wait_for(lambda: served_runtime.stats.engine.running == 0, what="the freed slot")


def _metrics(live) -> dict[str, float]:
    connection = http.client.HTTPConnection(live.url.removeprefix("http://"), timeout=30)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    return {f"{sample.name}{sorted(sample.labels.items()) if sample.labels else ''}":
            sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples}


def test_metrics_count_requests_tokens_and_the_cache(live):
    before = _metrics(live)
    client = live.client()
    answer = client.completions.create(model="genai-qwen3-fp32", prompt="hello", max_tokens=5,
                                       temperature=0)
    after = _metrics(live)
    reason = answer.choices[0].finish_reason
    key = f"onnx_chunk_requests_total[('finish_reason', '{reason}')]"
    assert after[key] == before.get(key, 0) + 1
    assert after["onnx_chunk_time_to_first_token_seconds_count"] \
        == before["onnx_chunk_time_to_first_token_seconds_count"] + 1
    assert after["onnx_chunk_inter_token_seconds_count"] \
        == before["onnx_chunk_inter_token_seconds_count"] + answer.usage.completion_tokens - 1
    cache = live.runtime.stats.cache
    assert after["onnx_chunk_variant_compiles_total"] == cache.compiles >= 1
    hits = "onnx_chunk_variant_cache_hits_total"
    assert after[hits] > before[hits]
    assert after["onnx_chunk_variants"] == cache.variants
    assert after["onnx_chunk_variant_bytes"] == cache.bytes_held
    assert after["onnx_chunk_running_slots"] == 0 and after["onnx_chunk_queue_length"] == 0
    exchange(live, "POST", COMPLETIONS, {"prompt": "hi", "max_tokens": -1})
    rejected = "onnx_chunk_rejected_requests_total[('status', '400')]"
    assert _metrics(live)[rejected] == after.get(rejected, 0) + 1
