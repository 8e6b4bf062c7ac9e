"""Two replicas of the server under a local Ray Serve on 127.0.0.1 (skipped where ray is not
installed: it is the `ray` extra), routed by prefix affinity."""

from __future__ import annotations

import socket

import pytest

from tests.serve.conftest import EXPORT, MODEL_NAME

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'onnx-chunk[ray]')")
serve = pytest.importorskip("ray.serve")
# One pytest worker runs the whole module: ray.init in a second worker joins the local cluster
# the first started, and the first's shutdown kills the second's actors.
pytestmark = pytest.mark.xdist_group("ray")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    """The Qwen3 export as 2 replicas behind the ingress, routed by prefix; its openai client."""
    import openai

    from onnx_chunk.serve.ray import application

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(EXPORT, replicas=2, provider="cpu", cpus_per_replica=0.5,
                              batch=2, graceful_shutdown_s=1.0), route_prefix="/")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                            max_retries=0, timeout=60)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_the_openai_client_with_the_same_greedy_text(served):
    status = serve.status().applications["default"].deployments["onnx-chunk"]
    assert status.replica_states == {"RUNNING": 2}
    texts = {served.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                       max_tokens=8, temperature=0).choices[0].text
             for _ in range(6)}
    assert len(texts) == 1
    assert [model.id for model in served.models.list().data] == [MODEL_NAME]


def test_the_turns_of_each_conversation_land_on_the_same_replica(served):
    from onnx_chunk.serve.ray import REPLICA_HEADER

    homes: dict[int, set[str]] = {}
    conversations = {index: [{"role": "user", "content": f"Conversation {index}: tell me a "
                              "story about a lighthouse keeper and the sea."}]
                     for index in range(6)}
    for turn in range(4):
        for index, messages in conversations.items():
            raw = served.chat.completions.with_raw_response.create(
                model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0)
            homes.setdefault(index, set()).add(raw.headers[REPLICA_HEADER])
            answer = raw.parse().choices[0].message.content
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": f"And then, part {turn + 2}?"}]
    # each conversation stayed on one replica over its 4 turns (Ray's power of two choices
    # does so with probability 2^-18)
    assert all(len(replicas) == 1 for replicas in homes.values()), homes
    # a streamed answer comes through the ingress too, from the same replica
    with served.chat.completions.with_streaming_response.create(
            model=MODEL_NAME, messages=conversations[0], max_tokens=6, temperature=0,
            stream=True) as stream:
        assert stream.headers[REPLICA_HEADER] in homes[0]
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"


def test_a_refusal_comes_through_the_ingress_in_openai_shape(served):
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        served.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=4)
    assert refused.value.body["param"] == "messages"


# Last in this module: it shuts the replicas down.
def test_a_stream_cut_by_the_replicas_shutdown_ends_with_an_event(served):
    import json
    import threading

    stream = served.completions.with_streaming_response.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=1900, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    with stream as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        deleting = threading.Thread(target=serve.delete, args=("default",))
        deleting.start()
        events = [line for line in lines if line]
    deleting.join(60)
    last = events[-1]
    if last != "data: [DONE]":  # cut: an error event, never a bare end
        error = json.loads(last.removeprefix("data: "))["error"]
        assert error["code"] in ("replica_lost", "server_shutting_down"), error
