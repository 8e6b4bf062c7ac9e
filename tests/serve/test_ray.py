"""Two replicas of the server under a local Ray Serve (skipped where ray is not installed: it
is the `ray` extra, not in `test`)."""

from __future__ import annotations

import socket

import pytest

from tests.serve.conftest import EXPORT, MODEL_NAME

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'onnx-chunk[ray]')")
serve = pytest.importorskip("ray.serve")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_replicas_answer_the_openai_client_with_the_same_greedy_text():
    import openai

    from onnx_chunk.serve.ray import application

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(EXPORT, replicas=2, provider="cpu", cpus_per_replica=0.5,
                              batch=2), route_prefix="/")
        status = serve.status().applications["default"].deployments["onnx-chunk"]
        assert status.replica_states == {"RUNNING": 2}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        texts = {client.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                           max_tokens=8, temperature=0).choices[0].text
                 for _ in range(6)}
        assert len(texts) == 1
        assert [model.id for model in client.models.list().data] == [MODEL_NAME]
    finally:
        serve.shutdown()
        ray.shutdown()
