"""Prefix reuse through the server: a chat's second turn reuses the first turn's KV and says so
in `usage.prompt_tokens_details.cached_tokens` (as OpenAI and vLLM do), whole and streamed,
with the text of a server that reuses nothing; /metrics counts it; `--no-prefix-reuse`."""

from __future__ import annotations

import http.client

import pytest

from onnx_chunk.cli import main
from onnx_chunk.errors import ConfigError
from onnx_chunk.runtime import load
from tests.serve.conftest import EXPORT, MODEL_NAME, exchange, live_server

NEW_TOKENS = 10


def _chat(client, messages, **extra):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                          max_tokens=NEW_TOKENS, temperature=0, **extra)


def _two_turns(live):
    """A two-turn chat (the client resends the conversation); both answers."""
    client = live.client()
    messages = [{"role": "user", "content": "Name three rivers of Europe."}]
    first = _chat(client, messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And three of Asia?"}]
    return first, _chat(client, messages), messages


@pytest.fixture(scope="module")
def without_reuse():
    with load(EXPORT, provider="cpu", max_batch=2, prefix_reuse=False) as runtime, \
            live_server(runtime) as running:
        yield running


def test_a_second_chat_turn_reports_its_cached_tokens_and_the_same_text(live, without_reuse):
    first, second, messages = _two_turns(live)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # At least the whole first prompt came from the slot's KV, never more than the prompt less
    # the one token always fed.
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    plain_first, plain_second, plain_messages = _two_turns(without_reuse)
    assert plain_messages == messages
    assert plain_second.choices[0].message.content == second.choices[0].message.content
    assert plain_second.usage.prompt_tokens_details.cached_tokens == 0
    assert plain_first.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_usage_and_completions_report_cached_tokens(live):
    client = live.client()
    prompt = "One, two, three, four, five, six,"
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=NEW_TOKENS,
                                      temperature=0)
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=prompt + first.choices[0].text + " and then",
        max_tokens=NEW_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert first.usage.prompt_tokens <= usage.prompt_tokens_details.cached_tokens \
        < usage.prompt_tokens
    status, _, page = exchange(live, "POST", "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 3, "temperature": 0})
    assert status == 200 and "cached_tokens" in page["usage"]["prompt_tokens_details"]


def _scrape(live) -> dict[str, float]:
    connection = http.client.HTTPConnection(live.url.removeprefix("http://"), timeout=30)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        assert response.status == 200
        text = response.read().decode()
    finally:
        connection.close()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("onnx_chunk_prefix")}


def test_metrics_count_prefix_hits_and_reused_tokens(live):
    before = _scrape(live)
    _, second, _ = _two_turns(live)
    after = _scrape(live)
    engine = live.runtime.stats.engine
    assert after["onnx_chunk_prefix_hits_total"] >= before["onnx_chunk_prefix_hits_total"] + 1
    assert after["onnx_chunk_prefix_reused_tokens_total"] >= \
        before["onnx_chunk_prefix_reused_tokens_total"] \
        + second.usage.prompt_tokens_details.cached_tokens
    assert after["onnx_chunk_prefix_reused_tokens_total"] == engine.prefix_reused_tokens
    assert "onnx_chunk_prefix_refused_total" in after


def test_serve_no_prefix_reuse_loads_the_model_without_it(monkeypatch, capsys):
    import onnx_chunk.runtime

    asked = {}

    def refuse(model, **options):
        asked.update(options)
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(onnx_chunk.runtime, "load", refuse)
    assert main(["serve", str(EXPORT), "--provider", "cpu", "--port", "0",
                 "--no-prefix-reuse"]) == 2
    assert asked["prefix_reuse"] is False
    assert main(["serve", str(EXPORT), "--provider", "cpu", "--port", "0"]) == 2
    assert asked["prefix_reuse"] is True
    capsys.readouterr()
