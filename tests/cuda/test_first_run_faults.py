"""What the first GPU run would show and a CPU cannot, shown on CPU through the `graph_model`
fake (tests/cuda/conftest.py), which models it from ONNX Runtime's source: buffers copied at
bind time, device work during another thread's capture, ONNX Runtime's outputs overwritten by a
replay before they are read, a run without run options captured under graph id 0.

Each of these tests fails on a runtime that lacks the construction it checks (the identity
probe, the capture gate around allocations and frees, the read under the run lock, the
uncaptured run options) and passes with it.
"""

import threading
import time

import numpy as np
import onnxruntime as ort

from onnx_chunk.runtime import load
from onnx_chunk.runtime.caches.cuda_graphs import SKIP_CAPTURE, run_options
from onnx_chunk.runtime.device import run_lock
from onnx_chunk.runtime.device.allocation import ALLOCATIONS
from onnx_chunk.runtime.device.provider import PROBE_MODEL
from tests.cuda.test_device_inputs import PROMPT
from tests.cuda.test_graph_cache import GRAPH_DEVICE

OPTIONS = {"capacity": 96, "chunk_size": 16, "padding": False}
# Seven rows: a width outside the ladder, so a prefill of it runs uncaptured and its logits are
# the ones ONNX Runtime allocates in the session's arena.
SHORT = PROMPT[:7]


def _host(path):
    return load(path, provider="cpu", **OPTIONS)


def test_buffers_copied_when_bound_are_not_used(reference_model, graph_model):
    # Issue 44, point 1: an owned buffer whose device ONNX Runtime does not take as the
    # session's is copied at bind time, so a decode would read a stale past.
    graph_model.copies_at_bind = True
    expected = _host(reference_model()).open_sequence().generate(PROMPT, 8)
    live = ALLOCATIONS.live_buffers
    runtime = load(reference_model(), device=GRAPH_DEVICE, **OPTIONS)
    assert runtime.open_sequence().generate(PROMPT, 8) == expected
    # The probe's one copy showed it: every buffer then came from ONNX Runtime's allocator.
    assert graph_model.bind_copies == 1 and ALLOCATIONS.live_buffers == live
    assert graph_model.captures and not graph_model.violations
    runtime.close()


def test_buffers_bound_in_place_are_the_runtimes_own(reference_model, graph_model):
    live = ALLOCATIONS.live_buffers
    runtime = load(reference_model(), device=GRAPH_DEVICE, **OPTIONS)
    sequence = runtime.open_sequence()
    assert sequence.generate(PROMPT, 4) == _host(reference_model()).open_sequence().generate(
        PROMPT, 4)
    assert graph_model.bind_copies == 0 and ALLOCATIONS.live_buffers > live
    runtime.close()


def test_sequences_open_and_close_while_another_thread_captures(reference_model, graph_model):
    # Issue 44, point 3: a new sequence's buffers (allocated) and a closed one's (freed, with
    # no idle slot kept) while a capture is in flight in another thread.
    expected = _host(reference_model()).open_sequence().generate(PROMPT, 6)
    runtime = load(reference_model(), device=GRAPH_DEVICE, idle_sequences=0, **OPTIONS)
    graph_model.delay = 0.02
    done = threading.Event()
    out = []

    def capture_each_tier():
        try:
            out.append(runtime.open_sequence().generate(PROMPT, 6))
        finally:
            done.set()

    worker = threading.Thread(target=capture_each_tier)
    worker.start()
    opened = 0
    while not done.is_set():
        with runtime.open_sequence():
            opened += 1
    worker.join()
    assert out == [expected] and opened > 0
    assert runtime.stats.graphs.captures > 0 and not runtime.stats.graph_fallbacks
    assert not graph_model.violations, graph_model.violations[:3]
    runtime.close()


def test_every_row_logits_are_read_before_another_thread_replays(reference_model,
                                                                 graph_model):
    # Issue 44, point 4: logits ONNX Runtime allocated for an uncaptured run, read while a
    # replay of the same session runs in another thread.
    host = _host(reference_model())
    expected = host.open_sequence().prefill(SHORT, all_logits=True)
    runtime = load(reference_model(), device=GRAPH_DEVICE, **OPTIONS)
    replaying = runtime.open_sequence()
    token = int(np.argmax(replaying.prefill(PROMPT)))
    for _ in range(3):  # learn the shape, capture, replay
        token = int(np.argmax(replaying.decode(token)))
    graph_model.delay, graph_model.read_delay = 0.001, 0.005
    stop, steps = threading.Event(), []

    def replay():
        nonlocal token
        while not stop.is_set():
            token = int(np.argmax(replaying.decode(token)))
            steps.append(token)

    worker = threading.Thread(target=replay)
    worker.start()
    got = []
    try:
        # Reads until the other thread has replayed a while (bounded in time).
        began = time.monotonic()
        while (len(got) < 6 or len(steps) < 12) and time.monotonic() - began < 60:
            with runtime.open_sequence() as sequence:
                got.append(sequence.prefill(SHORT, all_logits=True))
    finally:
        stop.set()
        worker.join()
    assert len(got) >= 6 and len(steps) >= 12
    assert all(np.allclose(logits, expected, atol=1e-5) for logits in got)
    assert graph_model.clobbered == 0 and runtime.stats.graphs.replays >= 11
    assert not graph_model.violations, graph_model.violations[:3]
    runtime.close()


def test_a_run_without_options_on_a_capturing_session_runs_uncaptured(graph_model):
    # ONNX Runtime runs a capturing session's run without run options under graph id 0.
    session = ort.InferenceSession(PROBE_MODEL, providers=["CPUExecutionProvider"])
    run_lock.serialise_runs(session)
    graph_model.sessions.add(session)
    binding = session.io_binding()
    binding.bind_cpu_input("x", np.ones(1, dtype=np.float32))
    binding.bind_output("y")
    GRAPH_DEVICE.run(session, binding, None)
    assert graph_model.runs == [(id(session), SKIP_CAPTURE)] and not graph_model.violations


def test_the_fake_sees_an_address_that_moved_between_capture_and_replay(graph_model):
    # The model itself: a replay re-issues the addresses of its capture.
    session = ort.InferenceSession(PROBE_MODEL, providers=["CPUExecutionProvider"])
    graph_model.sessions.add(session)
    binding = session.io_binding()
    first, second = (ort.OrtValue.ortvalue_from_numpy(np.ones(1, dtype=np.float32))
                     for _ in range(2))
    binding.bind_ortvalue_input("x", first)
    binding.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.float32)))
    session.run_with_iobinding(binding, run_options(1))
    assert not graph_model.violations
    binding.bind_ortvalue_input("x", second)
    session.run_with_iobinding(binding, run_options(1))
    assert graph_model.violations == ["graph 1 replayed with [('in', 'x')] at other addresses "
                                      "than at its capture"]
