"""The engine's batched decode captures and replays CUDA graphs like a lone sequence's decode.

Run on CPU through the device-memory path, with sessions marked capturing (CPU sessions never
capture): the graph ids and run counts are the runtime's own bookkeeping.
"""

import dataclasses

import pytest

from onnx_chunk.runtime import load
from onnx_chunk.runtime.caches import variant_pool
from onnx_chunk.runtime.caches.cuda_graphs import CAPTURE_RUN, SKIP_CAPTURE
from tests.cuda.test_device_inputs import DEVICE

PROMPTS = [list(range(3, 40)), list(range(5, 12)), list(range(9, 30))]


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_the_batched_decode_captures_and_replays(reference_model, monkeypatch, recorded_runs,
                                                 variant):
    path = reference_model(variant)
    host = load(path, provider="cpu", capacity=96, chunk_size=16, max_batch=2)
    expected = host.generate_many(PROMPTS, 8, eos_token_id=[])
    monkeypatch.setattr(variant_pool, "session_captures", lambda session: True)
    runtime = load(path, device=dataclasses.replace(DEVICE, cuda_graphs=True), capacity=96,
                   chunk_size=16, padding=False, max_batch=2)
    recorded_runs.clear()
    assert runtime.generate_many(PROMPTS, 8, eos_token_id=[]) == expected
    graphs = [(session, graph) for session, graph in recorded_runs
              if graph not in (None, SKIP_CAPTURE)]
    # Only the batched decode's binding captures (the engine's prefill rows never do): one
    # graph id, two for a model whose state buffers alternate, each replayed past its capture.
    ids = {graph for _, graph in graphs}
    assert len(ids) == (2 if variant == "conv_hybrid" else 1)
    assert len({session for session, _ in graphs}) == 1
    assert all(sum(graph == g for _, graph in graphs) > CAPTURE_RUN + 1 for g in ids)
    stats = runtime.stats
    assert stats.graphs_captured == len(ids) and stats.graphs_by_width == {1: len(ids)}
    assert not stats.graph_fallbacks
    runtime.close()
    assert runtime.stats.graphs_captured == len(ids)
