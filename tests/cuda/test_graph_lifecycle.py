"""CUDA graph and device-memory lifecycle on CPU: pooled sequence slots, graph release, the
capture gate, input synchronisation, capture fallback, freeing evicted sessions and runtimes.

CPU sessions never capture, so the sessions are marked capturing (`variant_pool.
session_captures`) and the graph bookkeeping runs on the graph ids and run counts alone.
"""

import dataclasses
import gc
import threading
import time
import weakref

import numpy as np
import onnxruntime as ort
import pytest

from onnx_chunk.errors import ClosedError, ConfigError
from onnx_chunk.runtime import load
from onnx_chunk.runtime.caches import variant_pool
from onnx_chunk.runtime.caches.cuda_graphs import (
    CAPTURE_GATE,
    CAPTURE_RUN,
    SKIP_CAPTURE,
    CaptureGate,
)
from onnx_chunk.runtime.device.provider import Device
from onnx_chunk.runtime.device.session_factory import SessionFactory
from onnx_chunk.runtime.engine.sequence_pool import SequencePool
from tests.cuda.test_device_inputs import DEVICE, PROMPT


@pytest.fixture
def capturing(monkeypatch):
    """Every specialised session counts as capturing CUDA graphs."""
    monkeypatch.setattr(variant_pool, "session_captures", lambda session: True)


@pytest.fixture
def released_graphs(monkeypatch):
    """Every graph id handed to release_captured_graph."""
    released = []
    monkeypatch.setattr(ort.InferenceSession, "release_captured_graph",
                        lambda self, graph: released.append(graph))
    return released


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


# Per-width sessions of the CUDA path with graphs on (CPU sessions are created without capture
# and marked capturing by `capturing`).
GRAPH_DEVICE = dataclasses.replace(DEVICE, cuda_graphs=True)


def _load(path, **options):
    return load(path, device=GRAPH_DEVICE, capacity=96, chunk_size=16,
                **{"padding": False, **options})


def _decode_ids(runtime, slot):
    """The graph ids of `slot`'s decode binding."""
    with runtime.debug.cache.acquire(1) as session:
        return runtime.debug.variants.bindings(session, slot)[1].graphs.ids


def test_a_closed_sequence_hands_its_buffers_and_graphs_to_the_next(reference_model, capturing,
                                                                    recorded_runs):
    runtime = _load(reference_model())
    expected = _load(reference_model()).open_sequence().generate(PROMPT, 5)
    with runtime.open_sequence() as first:
        assert first.generate(PROMPT, 5) == expected
        slot, kv = first.slot, first.buffers.kv
    assert first.closed
    with pytest.raises(ClosedError, match="closed"):
        first.generate(PROMPT, 2)
    first_ids = {graph for _, graph in recorded_runs if graph not in (None, SKIP_CAPTURE)}
    recorded_runs.clear()
    second = runtime.open_sequence()
    assert (second.slot, second.buffers.kv) == (slot, kv)
    assert second.length == 0
    assert second.generate(PROMPT, 5) == expected
    # Every binding is already there: nothing runs a first run again; only the 13-row
    # remainder (45 = 16 + 16 + 13, padding off) runs uncaptured, under -1.
    graphs = [graph for _, graph in recorded_runs if graph is not None]
    assert graphs.count(SKIP_CAPTURE) == 1
    assert {graph for graph in graphs if graph != SKIP_CAPTURE} == first_ids
    stats = runtime.stats.sequences
    assert (stats.created, stats.reused) == (1, 1)


def test_a_collected_sequence_gives_its_slot_back(reference_model, no_gc):
    runtime = _load(reference_model())
    sequence = runtime.open_sequence()
    sequence.generate(PROMPT, 2)
    slot = sequence.slot
    del sequence
    assert runtime.open_sequence().slot == slot
    assert runtime.stats.sequences.reused == 1


@pytest.mark.parametrize("releases", [False, True])
def test_freed_slots_release_graphs_only_where_the_provider_frees_them(reference_model,
                                                                      graph_model, releases):
    graph_model.releases = releases
    runtime = _load(reference_model(), idle_sequences=1)
    sequences = [runtime.open_sequence() for _ in range(3)]
    assert [sequence.slot for sequence in sequences] == [0, 1, 2]
    for sequence in sequences:
        sequence.generate(PROMPT, 5)
    stats = runtime.stats.graphs
    # The plan has two decode keys at batch 1 (the engine's and a lone sequence's): slots 0
    # and 1 capture their decode, slot 2 runs it uncaptured; one 16-row tier key (slot 0).
    assert stats.by_width == {1: 2, 16: 1} and stats.alive == 3 <= stats.planned
    assert stats.outside_plan == 3  # slot 1's tier, slot 2's decode and tier
    ids = [_decode_ids(runtime, slot) for slot in range(3)]
    assert ids[2] == ()
    for sequence in sequences:
        sequence.close()
    runtime.debug.pool.settle()
    # One slot stays idle (the last closed); the other two are freed.
    stats = runtime.stats
    assert (stats.sequences.freed, stats.sequences.idle) == (2, 1)
    if releases:
        assert sorted(graph_model.released) == sorted(graph for _, graph in
                                                      graph_model.captures)
        assert stats.graphs.alive == 0 and stats.graphs.released == 3
    else:
        # The CUDA provider frees graphs only with the session: no release call is made,
        # and the freed slots' graphs stay alive (and counted) with their keys taken.
        assert graph_model.released == []
        assert (stats.graphs.alive, stats.graphs.stranded, stats.graphs.released) == (3, 3, 0)
    assert stats.graphs.alive == len(graph_model.alive) and not graph_model.violations


def test_pool_rules():
    made, freed = [], []

    def make(number):
        made.append(number)
        return _FakeSlot(number)

    pool = SequencePool(make, freed.append, keep=1)
    a, b = pool.take(), pool.take()
    assert (a.number, b.number) == (0, 1)
    pool.give_back(a)
    pool.give_back(b)
    assert freed == [] and pool.stats().idle == 0  # queued only, settled on the next call
    c = pool.take()
    assert c is b and c.resets == 1 and freed == [0]
    assert pool.take().number == 0
    pool.give_back(c)
    pool.close()
    assert freed == [0, 1]
    with pytest.raises(ClosedError):
        pool.take()
    with pytest.raises(ConfigError, match="at least 0"):
        SequencePool(make, freed.append, keep=-1)


@dataclasses.dataclass
class _FakeSlot:
    number: int
    resets: int = 0

    def reset(self):
        self.resets += 1


def test_an_evicted_session_is_freed_before_its_replacement_builds(reference_model, monkeypatch,
                                                                   no_gc):
    runtime = _load(reference_model(), specialize="exact", max_variants=2)
    alive, seen = {}, []
    original = SessionFactory.create

    def create(self, width, **options):
        seen.append((width, sorted(w for w, ref in alive.items() if ref() is not None)))
        session = original(self, width, **options)
        alive[width] = weakref.ref(session)
        return session

    monkeypatch.setattr(SessionFactory, "create", create)
    sequence = runtime.open_sequence()
    for length in (5, 7, 9):
        sequence.rewind(sequence.length)
        sequence.prefill(PROMPT[:length])
    assert seen == [(5, []), (7, [5]), (9, [7])]


def test_a_runtime_is_freed_with_its_last_reference(reference_model, no_gc):
    runtime = _load(reference_model())
    sequence = runtime.open_sequence()
    sequence.generate(PROMPT, 3)
    with runtime.debug.cache.acquire(1) as session:
        session_ref = weakref.ref(session)
    runtime_ref = weakref.ref(runtime)
    del runtime, sequence, session
    assert runtime_ref() is None and session_ref() is None


def test_close_frees_at_once_and_refuses_later_calls(reference_model, no_gc):
    with _load(reference_model()) as runtime:
        sequence = runtime.open_sequence()
        sequence.generate(PROMPT, 3)
        with runtime.debug.cache.acquire(1) as session:
            session_ref = weakref.ref(session)
        del session
    assert runtime.closed and session_ref() is None
    runtime.close()
    with pytest.raises(ClosedError, match="closed"):
        runtime.open_sequence()
    with pytest.raises(ClosedError, match="closed"):
        sequence.generate(PROMPT, 2)
    assert runtime.stats.cache.variants == 0


def test_capture_gate_excludes_other_device_work():
    gate, events = CaptureGate(), []
    entered = threading.Event()

    def capture():
        with gate.exclusive():
            events.append("capture")

    with gate.shared():
        worker = threading.Thread(target=capture)
        worker.start()
        time.sleep(0.05)
        events.append("shared done")
    worker.join(5)
    assert events == ["shared done", "capture"]

    def other():
        entered.set()
        with gate.shared():
            events.append("other")

    with gate.exclusive():
        assert gate.capturing
        worker = threading.Thread(target=other)
        worker.start()
        entered.wait(5)
        time.sleep(0.05)
        events.append("capture 2")
    worker.join(5)
    assert events[2:] == ["capture 2", "other"] and not gate.capturing


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_capture_runs_hold_the_gate_alone(reference_model, capturing, gated_runs, variant):
    runtime = _load(reference_model(variant))
    runtime.open_sequence().generate(PROMPT, 9)
    per_graph: dict[tuple[int, int], list[bool]] = {}
    for session, graph, alone in gated_runs:
        if graph not in (None, SKIP_CAPTURE):
            per_graph.setdefault((session, graph), []).append(alone)
        else:
            assert not alone
    # The decode graphs (one, or two for the alternating state buffers) replayed past their
    # capture; the first user run under every id is its capture, and it alone held the gate.
    assert sum(len(runs) > 1 for runs in per_graph.values()) == (
        2 if variant == "conv_hybrid" else 1)
    for runs in per_graph.values():
        assert runs == [index == CAPTURE_RUN for index in range(len(runs))]


def test_inputs_are_synchronised_before_every_run_off_the_host(reference_model, monkeypatch,
                                                               recorded_runs):
    synced = []
    monkeypatch.setattr(ort.IOBinding, "synchronize_inputs",
                        lambda self: synced.append(len(recorded_runs)))
    _load(reference_model()).open_sequence().generate(PROMPT, 4)
    assert synced == list(range(len(recorded_runs))) and synced
    synced.clear()
    recorded_runs.clear()
    load(reference_model(), provider="cpu", capacity=96).open_sequence().generate(PROMPT, 2)
    assert recorded_runs and not synced  # host memory: nothing to synchronise


@dataclasses.dataclass(frozen=True)
class _FailingCapture(Device):
    """The CPU stand-in whose capture runs fail as a CUDA capture can (the first user run
    under a graph id, which is the capture)."""

    def run(self, session, binding, options, then=None):
        graph = None if options is None else options.get_run_config_entry("gpu_graph_id")
        if graph not in (None, str(SKIP_CAPTURE)):
            counts = _FailingCapture.counts
            counts[(id(session), graph)] = counts.get((id(session), graph), 0) + 1
            if counts[(id(session), graph)] == CAPTURE_RUN + 1:
                raise RuntimeError("operation not permitted when stream is capturing")
        return super().run(session, binding, options, then)


_FailingCapture.counts = {}


def test_a_failed_capture_falls_back_to_running_without_a_graph(reference_model, capturing,
                                                                recorded_runs):
    device = _FailingCapture(**{field.name: getattr(GRAPH_DEVICE, field.name)
                                for field in dataclasses.fields(GRAPH_DEVICE) if field.init})
    runtime = load(reference_model(), device=device, capacity=96, chunk_size=16, padding=False)
    expected = _load(reference_model()).open_sequence().generate(PROMPT, 8)
    assert runtime.open_sequence().generate(PROMPT, 8) == expected
    stats = runtime.stats
    # The first user run under each id captures, so it is the one that fails: the decode
    # width's and the 16-row tier's (the second full chunk), each falling back in that run.
    assert set(stats.graph_fallbacks) == {1, 16}
    assert "stream is capturing" in stats.graph_fallbacks[1]
    assert stats.graphs_captured == 0
    # After the failure the decode width runs without a graph, for new sequences too.
    recorded_runs.clear()
    assert runtime.open_sequence().generate(PROMPT, 4) == expected[:4]
    # The decode session is the one run most often (three decode steps against one prefill).
    decode = max(recorded_runs, key=recorded_runs.count)[0]
    assert {graph for session, graph in recorded_runs if session == decode} == {SKIP_CAPTURE}


def test_captured_prefill_widths_keep_one_logits_row(reference_model, capturing):
    runtime = _load(reference_model(), padding=True)
    host = load(reference_model(), provider="cpu", capacity=96, chunk_size=16)
    sequence = runtime.open_sequence()
    assert sequence.generate(PROMPT, 4) == host.open_sequence().generate(PROMPT, 4)
    vocab = runtime.stats.vocab_size
    with runtime.debug.cache.acquire(16) as session:
        kept = runtime.debug.variants.bindings(session, sequence.slot)[16].logits
    assert kept.shape == (1, 1, vocab)  # not [1, 16, vocab] per sequence
    # A caller that needs every row gets them all, padded chunks included (45 = 16 + 16 + 13).
    sequence.rewind(sequence.length)
    every = sequence.prefill(PROMPT, all_logits=True)
    expected = host.open_sequence().prefill(PROMPT, all_logits=True)
    assert every.shape == (len(PROMPT), vocab)
    np.testing.assert_allclose(every, expected, rtol=0, atol=1e-5)


def test_a_slot_taken_by_another_thread_keeps_its_bindings_and_graphs(reference_model,
                                                                     graph_model):
    runtime = _load(reference_model())
    with runtime.open_sequence() as first:
        first.generate(PROMPT, 5)
    assert runtime.stats.graphs_captured == 2  # decode and the 16-row tier
    taken = []
    # The sequence pool claims a slot taken by another thread: its bindings and graph ids stay
    # (the CUDA provider frees graphs only with the session, so dropping them would strand
    # them), and each id's next run, in the new thread, runs as a capture.
    worker = threading.Thread(target=lambda: taken.append(runtime.open_sequence()))
    worker.start()
    worker.join(10)
    assert taken[0].slot == first.slot
    assert graph_model.released == []
    graphs = runtime.stats.graphs
    assert (graphs.alive, graphs.stranded) == (2, 0) and graphs.alive <= graphs.planned
    with runtime.debug.cache.acquire(1) as session:
        assert runtime.debug.variants.bindings(session, taken[0].slot)
    taken[0].generate(PROMPT, 5)
    after = runtime.stats.graphs
    assert after.alive == 2 and after.stranded == 0 and after.alive <= after.planned


def test_claimed_bindings_keep_their_ids_and_run_their_next_run_as_a_capture(
        reference_model, graph_model, gated_runs):
    # The batch engine's new thread claims the batched decode's bindings (EngineContext's
    # release_graphs): same ids, no key taken, nothing released, and the first run of each id
    # after the claim holds the gate alone (it may capture in the new thread's context).
    runtime = _load(reference_model(), max_batch=2)
    prompts = [PROMPT, PROMPT[:9]]
    expected = load(reference_model(), provider="cpu", capacity=96, chunk_size=16,
                    max_batch=2).generate_many(prompts, 5, eos_token_id=[])
    assert runtime.generate_many(prompts, 5, eos_token_id=[]) == expected
    first = runtime.stats.graphs
    batch_ids = {graph for _, graph in graph_model.captures}
    assert batch_ids and first.by_width == {1: len(batch_ids)}
    runtime.debug.variants.claim(runtime.debug.engine.batch_number)
    gated_runs.clear()
    assert runtime.generate_many(prompts, 5, eos_token_id=[]) == expected
    again = runtime.stats.graphs
    assert (again.captures, again.alive) == (first.captures, first.alive)
    assert again.recaptures == len(batch_ids)
    after = [(graph, alone) for _, graph, alone in gated_runs if graph in batch_ids]
    assert {graph for graph, _ in after} == batch_ids
    firsts = {graph: alone for graph, alone in reversed(after)}
    assert all(firsts.values())
    assert sum(alone for _, alone in after) == len(batch_ids)
    assert graph_model.released == [] and not graph_model.violations
    runtime.close()


def test_a_stream_stops_once_its_sequence_is_closed(reference_model):
    runtime = _load(reference_model())
    sequence = runtime.open_sequence()
    stream = sequence.stream(PROMPT, 5)
    next(stream)
    next(stream)
    sequence.close()
    with pytest.raises(ClosedError, match="closed"):
        next(stream)


def test_the_batch_engine_decode_shares_the_capture_gate(reference_model, capturing,
                                                         monkeypatch):
    # Every run of the engine (its prefill chunks and its batched decode) holds the gate, so
    # no other thread's capture can start while it runs.
    ours: weakref.WeakSet = weakref.WeakSet()
    monkeypatch.setattr(variant_pool, "session_captures",
                        lambda session: ours.add(session) or True)
    runtime = load(reference_model(), device=dataclasses.replace(DEVICE, cuda_graphs=True),
                   capacity=96, chunk_size=16, padding=False)
    held = []
    original = ort.InferenceSession.run_with_iobinding

    def run(self, iobinding, run_options=None):
        # This runtime's sessions only: an earlier test's engine thread may still be stepping.
        if self in ours:
            held.append(CAPTURE_GATE.held)
        return original(self, iobinding, run_options)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", run)
    assert runtime.debug.device.cuda_graphs
    runtime.submit(PROMPT, 6).result()
    assert held and all(held)
    runtime.close()
