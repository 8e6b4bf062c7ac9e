"""CUDA graph planning on CPU: which sessions capture, provider options, graph ids per binding."""

import dataclasses
import threading

import numpy as np
import onnxruntime as ort
import pytest

from onnx_chunk.errors import ConfigError
from onnx_chunk.runtime import load
from onnx_chunk.runtime.caches import variant_pool
from onnx_chunk.runtime.caches.cuda_graphs import (
    SKIP_CAPTURE,
    capturable,
    graph_runs,
    session_captures,
)
from onnx_chunk.runtime.caches.graph_cache import GraphCache, GraphPlan, plan_graphs
from onnx_chunk.runtime.device.provider import Device, MaskPolicy, device_for

PROMPT = np.random.default_rng(11).integers(0, 256, 45).tolist()


def test_cuda_device_runs_one_capturing_session():
    device = device_for("cuda", 1)
    assert device.cuda_graphs and device.mask_policy is MaskPolicy.CAPACITY
    # One session per model on CUDA (one copy of the weights), capturing graphs per shape.
    assert device.specialize is False and capturable(device)
    assert not capturable(device_for("cuda", cuda_graphs=False))
    assert not capturable(device_for("cpu"))


def test_logical_mask_switches_graphs_off_or_conflicts():
    assert not device_for("cuda", mask_policy="logical").cuda_graphs
    with pytest.raises(ConfigError, match="capacity-wide mask"):
        device_for("cuda", mask_policy="logical", cuda_graphs=True)
    with pytest.raises(ConfigError, match="CPU provider"):
        device_for("cpu", cuda_graphs=True)


def test_provider_options_of_a_capturing_session():
    device = device_for("cuda", 2)
    plain, capture = device.providers(), device.providers(capture=True)
    assert plain[0] == ("CUDAExecutionProvider",
                        {"device_id": "2", "arena_extend_strategy": "kSameAsRequested"})
    assert capture[0][1] == {**plain[0][1], "enable_cuda_graph": "1"}
    assert capture[1] == plain[1] == ("CPUExecutionProvider", {})
    assert "enable_cuda_graph" not in device.session_providers[0][1]
    assert device_for("cpu").providers() == [("CPUExecutionProvider", {})]
    with pytest.raises(ConfigError):
        device_for("cpu").providers(capture=True)


def test_graph_ids_are_fresh_per_binding_and_never_use_the_reserved_id_0():
    # ONNX Runtime reserves gpu_graph_id 0 for internal use; ids start at 1.
    session = object()
    cache = GraphCache(GraphPlan((((1, 1), 2), ((1, 16), 1)), parities=2))
    assert cache.snapshot().planned == 6
    first, second = cache.new_runs(session, 1, 1, True), cache.new_runs(session, 1, 1, True)
    tier = cache.new_runs(session, 1, 16, True)
    assert (first.ids, second.ids, tier.ids) == ((1, 2), (3, 4), (5, 6))
    # Every planned key is held: the same shape again, or a shape outside the plan, runs
    # uncaptured (no id at all).
    held, outside = cache.new_runs(session, 1, 1, True), cache.new_runs(session, 1, 7, True)
    assert held.ids == outside.ids == () and held.failure and outside.failure
    assert cache.snapshot().outside_plan == 2
    with pytest.raises(ValueError):
        graph_runs((0,))
    entry = "gpu_graph_id"
    assert first.options(True, 1).get_run_config_entry(entry) == str(SKIP_CAPTURE)
    assert first.options(False, 0).get_run_config_entry(entry) == "1"
    assert second.options(False, 1).get_run_config_entry(entry) == "4"
    assert held.options(False, 1).get_run_config_entry(entry) == str(SKIP_CAPTURE)


def test_the_plan_counts_what_the_runtime_runs():
    # A lone sequence's decode and tiers, the engine's decode at its slot count; at batch 1
    # the engine's decode and a lone sequence's are two bindings of one shape.
    assert plan_graphs((16, 32), 8, stateful=False).planned == 4
    assert plan_graphs((16, 32), 1, stateful=False).count((1, 1)) == 2
    assert plan_graphs((16, 32), 4, stateful=True).planned == 8


def test_the_first_run_under_an_id_is_the_capture():
    runs = graph_runs((3,))
    assert not runs.captures_next(True, 0)  # the binding's first run: -1, learns shapes
    assert runs.captures_next(False, 0) and not runs.replays_next(False, 0)
    assert runs.ran(False, 0)  # that run captured
    assert not runs.captures_next(False, 0) and runs.replays_next(False, 0)
    assert not runs.ran(False, 0) and runs.captured == (3,)
    runs.claim()  # another thread: the next run may capture in its provider context
    assert runs.captures_next(False, 0) and not runs.ran(False, 0)
    assert runs.replays_next(False, 0)
    # A run in a thread other than the one that captured runs as a capture too, unclaimed.
    seen = []
    worker = threading.Thread(target=lambda: seen.append(
        (runs.captures_next(False, 0), runs.ran(False, 0), runs.captures_next(False, 0))))
    worker.start()
    worker.join(10)
    assert seen == [(True, False, False)]
    assert runs.captures_next(False, 0)  # back in this thread: the worker owns it now


def test_a_cpu_session_does_not_capture(reference_model):
    runtime = load(reference_model(), provider="cpu", capacity=96, chunk_size=16)
    runtime.open_sequence().generate(PROMPT, 3)
    with runtime.debug.cache.acquire(1) as session:
        assert not session_captures(session)
    stats = runtime.stats
    assert stats.cuda_graphs is False and stats.graph_widths == ()


def test_factory_falls_back_when_capture_is_refused(reference_model, monkeypatch):
    runtime = load(reference_model(), provider="cpu", capacity=96, chunk_size=16)
    factory = runtime.debug.factory
    tried = []
    original = Device.providers

    def providers(self, capture=False):
        # What the session is created with: the provider refuses the capturing one.
        tried.append(capture)
        if capture:
            raise RuntimeError("a node is not on the CUDA provider")
        return original(self, capture)

    monkeypatch.setattr(Device, "providers", providers)
    session = factory.create(16, prepack=False, capture=True)
    assert tried == [True, False]
    assert isinstance(session, ort.InferenceSession) and not session_captures(session)


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_graph_runs_on_cpu_sessions_marked_capturing(reference_model, monkeypatch,
                                                     recorded_runs, variant):
    """The graph-id plumbing of per-width CUDA sessions (`specialize=True`), run on CPU
    sessions marked as capturing.

    Each binding's first run skips capture; a stateless model runs every later forward of a
    binding under one graph id, a stateful one alternates two (its state buffers alternate);
    two sequences get distinct ids; results equal a runtime without graphs.
    """
    path = reference_model(variant)
    device = dataclasses.replace(device_for("cpu"), host_visible=False,
                                 mask_policy=MaskPolicy.CAPACITY, specialize=True)
    reference = load(path, device=device, capacity=96, chunk_size=16)
    expected = [reference.open_sequence().generate(PROMPT, 5) for _ in range(2)]
    monkeypatch.setattr(variant_pool, "session_captures", lambda session: True)
    runtime = load(path, device=dataclasses.replace(device, cuda_graphs=True), capacity=96,
                   chunk_size=16, padding=False)
    recorded_runs.clear()
    first, second = runtime.open_sequence(), runtime.open_sequence()
    assert first.generate(PROMPT, 5) == expected[0]
    decode_session = next(session for session, graph in reversed(recorded_runs))
    decode_runs = [graph for session, graph in recorded_runs if session == decode_session]
    before_second = len(recorded_runs)
    assert second.generate(PROMPT, 5) == expected[1]
    second_runs = [graph for session, graph in recorded_runs[before_second:]
                   if session == decode_session]
    stateful = variant == "conv_hybrid"
    assert decode_runs[0] == SKIP_CAPTURE and second_runs[0] == SKIP_CAPTURE
    assert len(set(decode_runs[1:])) == len(set(second_runs[1:])) == (2 if stateful else 1)
    assert not set(decode_runs[1:]) & set(second_runs[1:])
    if stateful:
        assert all(a != b for a, b in zip(decode_runs[1:], decode_runs[2:]))
    # Width 16 (full chunks) and the decode width capture; the 13-row remainder (padding off)
    # runs on the shape-generic session, under -1 only.
    captured = {session for session, graph in recorded_runs if graph != SKIP_CAPTURE}
    assert len(captured) == 2
    assert len({session for session, _ in recorded_runs} - captured) == 1
    assert set(runtime.stats.graph_widths) <= {1, 16}
