"""One session per model on the CUDA path, CUDA graphs as its bounded cache: run on CPU.

The CPU device marked not host-visible, with the capacity mask and CUDA graphs on, runs the
CUDA path's code (CPU sessions are created without capture and counted as capturing); the
`graph_model` fake counts runs per graph id as ONNX Runtime's CUDA provider does, so the
captures, replays and releases below are what a GPU would see.
"""

import contextlib
import dataclasses
import gc
import threading

import numpy as np
import pytest

from onnx_chunk.runtime import load
from onnx_chunk.runtime.caches.cuda_graphs import SKIP_CAPTURE
from onnx_chunk.runtime.caches.graph_cache import GraphCache, GraphPlan, plan_graphs
from tests.cuda.test_device_inputs import DEVICE

# The CUDA device's shape on CPU: device memory, the capacity mask, graphs on, one session.
GRAPH_DEVICE = dataclasses.replace(DEVICE, cuda_graphs=True, specialize=False)
RNG = np.random.default_rng(22)
# Remainders 3, 5, 9, 13 and 15 past full 16-row chunks: five widths the ladder pads.
PROMPTS = [RNG.integers(0, 256, n).tolist() for n in (3, 21, 41, 13, 47)]
BATCH = [RNG.integers(0, 256, n).tolist() for n in (5, 9, 17, 30, 2, 11, 26, 40)]


def _load(path, **options):
    return load(path, device=GRAPH_DEVICE, capacity=96, chunk_size=16, **options)


def _host(path, **options):
    return load(path, provider="cpu", capacity=96, chunk_size=16, **options)


def _generate(runtime, prompts, tokens=6):
    out = []
    for prompt in prompts:
        with runtime.open_sequence() as sequence:
            out.append(sequence.generate(prompt, tokens))
    return out


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_one_session_serves_every_width_and_batch(reference_model, graph_model, variant):
    path = reference_model(variant)
    expected = _generate(_host(path), PROMPTS)
    expected_batch = _host(path, max_batch=8).generate_many(BATCH, 6, eos_token_id=[])
    runtime = _load(path, max_batch=8)
    graph_model.runs.clear()
    # The plan refuses padding for a model with recurrent state: its remainders run uncaptured.
    assert (runtime.stats.padding != "off") is (variant == "base")
    assert runtime.stats.specialize is False
    assert _generate(runtime, PROMPTS) == expected
    assert runtime.generate_many(BATCH, 6, eos_token_id=[]) == expected_batch
    stats = runtime.stats
    # One ONNX Runtime session ran every forward: prefill tiers, decode, the batch of 8.
    assert len({session for session, _ in graph_model.runs}) == 1
    assert (stats.sessions, stats.sessions_created, stats.cache.compiles) == (1, 1, 1)
    assert stats.weights_copies == 1
    # Decode (lone and batched) and the ladder tiers captured; graphs replayed after.
    assert set(stats.graphs.by_width) <= {1, *runtime.stats.ladder}
    assert 1 in stats.graphs.by_width and stats.graphs.replays > 0
    assert stats.graphs.captures == len(graph_model.captures) and not graph_model.violations


def test_weights_copies_and_sessions_are_counted_from_sessions(reference_model):
    path = reference_model()
    # CPU default and the device-memory path: five remainder widths, then a batch of 8.
    for runtime in (_host(path, max_batch=8), _load(path, max_batch=8)):
        # The one shape-generic session is built at load (a runtime ready to run).
        assert (runtime.stats.sessions, runtime.stats.weights_copies) == (1, 1)
        _generate(runtime, PROMPTS)
        runtime.generate_many(BATCH, 4, eos_token_id=[])
        assert (runtime.stats.sessions, runtime.stats.weights_copies) == (1, 1)
    per_width = _host(path, specialize="exact", padding=False, max_variants=2)
    _generate(per_width, PROMPTS)
    stats = per_width.stats
    # Released sessions are no longer counted once freed; the shared host copy, and the
    # decode session's packed copy (it pre-packs) while it is alive.
    assert stats.sessions == stats.cache.variants == 2 and stats.cache.evictions > 0
    assert stats.weights_copies == 1 + (1 in stats.cache.variant_bytes)
    per_width.close()
    gc.collect()
    assert (per_width.stats.sessions, per_width.stats.weights_copies) == (0, 1)


def test_graph_ids_are_distinct_per_shape_and_addresses_and_reused(reference_model,
                                                                   graph_model):
    runtime = _load(reference_model())
    expected = _generate(_host(reference_model()), PROMPTS)
    graph_model.runs.clear()
    assert _generate(runtime, PROMPTS) == expected
    [per_slot] = runtime.debug.variants.live_bindings()
    ids_by_binding = {}
    for slot, bindings in per_slot.items():
        for name, binding in bindings.items():
            if binding.graphs is not None and binding.graphs.ids:
                ids_by_binding[(slot, name)] = binding.graphs.ids
    every = [graph for ids in ids_by_binding.values() for graph in ids]
    assert len(every) == len(set(every)) and min(every) >= 1
    assert runtime.stats.graphs.captures == len(graph_model.captures) > 0
    # Pass 2: the same prompts on the pooled slot run the same bindings (no first run, no new
    # id); a width run too rarely in pass 1 to reach its capture may capture now, once.
    graph_model.runs.clear()
    assert _generate(runtime, PROMPTS) == expected
    ran = {graph for _, graph in graph_model.runs if graph is not None}
    assert SKIP_CAPTURE not in ran and ran <= set(every)
    assert len(set(graph_model.captures)) == len(graph_model.captures)
    assert runtime.stats.graphs.captures == len(graph_model.captures)
    assert not graph_model.violations


def test_a_server_like_run_captures_each_planned_key_once(reference_model, graph_model):
    """200 requests (five remainder widths, batches of 1 to 8, slots reused), with a lone
    sequence beside now and then: one capture per planned key, `alive <= planned` after every
    batch, nothing released (the CUDA provider cannot), nothing ONNX Runtime would refuse."""
    path = reference_model()
    runtime = _load(path, max_batch=8)
    host = _host(path, max_batch=8)
    planned = runtime.stats.graphs.planned
    assert planned == runtime.debug.variants.graphs.plan.planned > 0
    served, batch = 0, 0
    while served < 200:
        size = min(1 + batch % 8, 200 - served)
        prompts = [PROMPTS[(served + index) % len(PROMPTS)] for index in range(size)]
        got = runtime.generate_many(prompts, 3, eos_token_id=[])
        if batch % 8 == 0:
            assert got == host.generate_many(prompts, 3, eos_token_id=[])
        if batch % 5 == 0:
            _generate(runtime, [PROMPTS[(batch // 5) % len(PROMPTS)]], tokens=3)
            served += 1
        served += size
        batch += 1
        graphs = runtime.stats.graphs
        assert graphs.alive <= planned and len(graph_model.alive) <= planned
    graphs = runtime.stats.graphs
    assert len(graph_model.captures) == len(set(graph_model.captures)) == graphs.captures
    assert graphs.alive == graphs.captures == len(graph_model.alive) <= planned
    # The engine's batched decode and the lone sequence's decode and tiers captured.
    assert graphs.by_width[1] == 2 and {1} < set(graphs.by_width) <= {1, *runtime.stats.ladder}
    assert graph_model.peak_alive <= planned and graph_model.released == []
    assert runtime.stats.sequences.reused > 0 and not graph_model.violations
    runtime.close()


def test_a_failed_capture_falls_back_without_reaching_the_caller(reference_model,
                                                                graph_model):
    path = reference_model()
    runtime = _load(path)
    graph_model.fail_capture = {1, 2, 3, 4, 5, 6}
    assert _generate(runtime, PROMPTS[:2]) == _generate(_host(path), PROMPTS[:2])
    stats = runtime.stats.graphs
    assert stats.captures == stats.alive == 0 and 1 in stats.fallbacks
    assert "stream is capturing" in stats.fallbacks[1]


@contextlib.contextmanager
def _threads(runtime, count: int):
    """Prompts 0..count-1 generated each in a thread of its own while the block runs; yields
    (results by index, errors), complete once the block has ended."""
    results: dict[int, list[int]] = {}
    errors: list[Exception] = []

    def work(index):
        try:
            results[index] = _generate(runtime, PROMPTS[index:index + 1])[0]
        except Exception as error:  # reported by the caller
            errors.append(error)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    try:
        yield results, errors
    finally:
        for thread in threads:
            thread.join(60)


def test_two_threads_on_one_capturing_runtime_are_serialised(reference_model, graph_model):
    path = reference_model()
    runtime = _load(path)
    expected = _generate(_host(path), PROMPTS[:4])
    graph_model.delay = 0.003
    with _threads(runtime, 4) as (results, errors):
        pass
    assert not errors and [results[index] for index in range(4)] == expected
    # The fake flags two runs of one session in flight at once: the run lock kept them apart.
    assert not graph_model.violations


def test_a_capture_never_runs_beside_another_forward(reference_model, graph_model):
    path = reference_model()
    runtime = _load(path, max_batch=2)
    expected = _generate(_host(path), PROMPTS)
    graph_model.delay = 0.002
    with _threads(runtime, len(PROMPTS)) as (results, errors):
        engine = runtime.generate_many(BATCH[:4], 6, eos_token_id=[])
    assert not errors and [results[index] for index in range(len(PROMPTS))] == expected
    assert engine == _host(path, max_batch=2).generate_many(BATCH[:4], 6, eos_token_id=[])
    assert graph_model.captures and not graph_model.violations


def test_the_graph_cache_measures_captures_and_strands_what_it_cannot_release(monkeypatch):
    released = []

    class Session:
        def release_captured_graph(self, graph):
            released.append(graph)

    monkeypatch.setattr("onnx_chunk.runtime.caches.graph_cache.measured",
                        lambda meter, action: (action(), 64))
    cache = GraphCache(GraphPlan((((1, 1), 1), ((1, 16), 1))), meter=object())
    session = Session()
    decode, tier = cache.new_runs(session, 1, 1, False), cache.new_runs(session, 1, 16, False)
    assert (decode.ids, tier.ids) == ((1,), (2,))
    for runs, width in ((decode, 1), (tier, 16)):
        assert cache.capture(session, runs, 0, width, lambda options: None)
    stats = cache.snapshot()
    assert (stats.planned, stats.alive, stats.captures, stats.bytes) == (2, 2, 2, 128)
    # A provider that cannot release: no call, the graph stays alive and its key taken.
    monkeypatch.setattr("onnx_chunk.runtime.caches.cuda_graphs.releases_graphs",
                        lambda session: False)
    assert cache.release(session, decode) == 0 and released == []
    assert cache.new_runs(session, 1, 1, False).ids == ()
    stats = cache.snapshot()
    assert (stats.alive, stats.stranded, stats.released) == (2, 1, 0)
    # One that can: the key is free again.
    monkeypatch.setattr("onnx_chunk.runtime.caches.cuda_graphs.releases_graphs",
                        lambda session: True)
    assert cache.release(session, tier) == 1 and released == [2]
    assert cache.new_runs(session, 1, 16, False).ids == (3,)
    # The session goes: every graph with it, and the plan's keys are free.
    cache.forget_session(session)
    stats = cache.snapshot()
    assert (stats.alive, stats.bytes, stats.stranded) == (0, 0, 0)
    assert cache.new_runs(session, 1, 1, False).ids == (4,)


def test_replan_recreates_the_session(reference_model, graph_model):
    runtime = _load(reference_model())
    _generate(runtime, PROMPTS[:1])
    with runtime.debug.cache.acquire(None) as session:
        old = session
    assert runtime.stats.graphs.alive > 0
    assert not runtime.debug.variants.replan(runtime.debug.variants.graphs.plan)
    assert runtime.debug.variants.replan(plan_graphs(runtime.stats.ladder, 4, False))
    graphs = runtime.stats.graphs
    assert (graphs.recreations, graphs.alive, graphs.planned) == (1, 0, 5)
    _generate(runtime, PROMPTS[:1])
    with runtime.debug.cache.acquire(None) as session:
        assert session is not old
    assert runtime.stats.graphs.alive > 0 and not graph_model.violations
