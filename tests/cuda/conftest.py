"""Fixtures of the CUDA-path tests (run on CPU)."""

import threading
import time

import onnxruntime as ort
import pytest

from onnx_chunk.runtime.caches import cuda_graphs


@pytest.fixture
def recorded_runs(monkeypatch):
    """Every run_with_iobinding: (session id, graph id or None without run options)."""
    runs = []
    original = ort.InferenceSession.run_with_iobinding

    def run(self, iobinding, run_options=None):
        runs.append((id(self), None if run_options is None
                     else int(run_options.get_run_config_entry("gpu_graph_id"))))
        return original(self, iobinding, run_options)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", run)
    return runs


@pytest.fixture
def gated_runs(monkeypatch):
    """Every run_with_iobinding: (session id, graph id or None, whether a capture held the
    gate)."""
    runs = []
    original = ort.InferenceSession.run_with_iobinding

    def run(self, iobinding, run_options=None):
        graph = (None if run_options is None
                 else int(run_options.get_run_config_entry("gpu_graph_id")))
        runs.append((id(self), graph, cuda_graphs.CAPTURE_GATE.capturing))
        return original(self, iobinding, run_options)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", run)
    return runs


class GraphRunsModel:
    """A recording fake of ONNX Runtime's CUDA graph bookkeeping around the real CPU runs.

    As `InferenceSession::Run` does (onnxruntime/core/session/inference_session.cc, "Start
    another run for necessary memory allocation or graph capture."), the first user run under a
    graph id not yet captured in the running thread's provider context is WARM_UPS regular
    runs, the capture and a replay, all inside that one call (`internal` records each); later
    user runs under the id replay. Graphs are kept per (session, id, thread), as the CUDA
    provider keeps them per thread context. `release_captured_graph` is a no-op (as on the CUDA
    provider: cuda_graph.cc ties graphs to the session) unless `releases` is set; every call is
    recorded in `released`. `alive` holds the graphs captured and not freed. `violations` lists
    what ONNX Runtime would not allow: a capture beside another run, two runs of one session at
    once, a run of a released graph id, a release of a graph never captured. `delay` (seconds)
    keeps each run in flight a while, so that runs of several threads overlap.
    """

    WARM_UPS = 2

    def __init__(self) -> None:
        self.runs: list[tuple[int, int | None]] = []
        self.internal: list[tuple[int, int, str]] = []
        self.captured: set[tuple[int, int, object]] = set()
        self.alive: set[tuple[int, int]] = set()
        self.gone: set[tuple[int, int]] = set()
        self.released: list[int] = []
        self.captures: list[tuple[int, int]] = []
        self.peak_alive = 0
        self.violations: list[str] = []
        self.delay = 0.0
        self.releases = False
        self.fail_capture: set[int] = set()
        self._in_flight = 0
        self._per_session: dict[int, int] = {}
        self._lock = threading.Lock()

    def run(self, session, graph: int | None) -> None:
        key = (id(session), graph)
        # The thread object, not its ident: an ident is reused by a later thread, an ONNX
        # Runtime thread_local context is not.
        thread = threading.current_thread()
        with self._lock:
            self.runs.append(key)
            self._in_flight += 1
            self._per_session[id(session)] = self._per_session.get(id(session), 0) + 1
            if self._per_session[id(session)] > 1:
                self.violations.append(f"two runs of session {id(session)} at once")
            if graph is not None and graph != cuda_graphs.SKIP_CAPTURE:
                if key in self.gone:
                    self.violations.append(f"graph {graph} ran after its release")
                if (id(session), graph, thread) not in self.captured:
                    self.internal.extend([(id(session), graph, "regular")] * self.WARM_UPS)
                    if self._in_flight > 1:
                        self.violations.append(f"graph {graph} captured beside another run")
                    if graph in self.fail_capture:
                        self._leave(session)
                        raise RuntimeError("operation not permitted when stream is capturing")
                    self.internal.extend([(id(session), graph, "capture"),
                                          (id(session), graph, "replay")])
                    self.captured.add((id(session), graph, thread))
                    self.captures.append(key)
                    self.alive.add(key)
                    self.peak_alive = max(self.peak_alive, len(self.alive))
                else:
                    self.internal.append((id(session), graph, "replay"))
        try:
            time.sleep(self.delay)
        finally:
            with self._lock:
                self._leave(session)

    def _leave(self, session) -> None:
        self._in_flight -= 1
        self._per_session[id(session)] -= 1

    def release(self, session, graph: int) -> None:
        key = (id(session), graph)
        with self._lock:
            self.released.append(graph)
            if key not in self.alive:
                self.violations.append(f"graph {graph} released but never captured")
            if self.releases:
                self.alive.discard(key)
                self.gone.add(key)
                self.captured = {held for held in self.captured if held[:2] != key}

    def user_runs(self, graph: int) -> int:
        return sum(1 for _, ran in self.runs if ran == graph)


@pytest.fixture
def graph_model(monkeypatch):
    """`GraphRunsModel` around every run_with_iobinding and release_captured_graph, with every
    session counted as capturing (CPU sessions never capture); its provider frees graphs on
    release only once `model.releases` is set (the runtime then calls the release)."""
    from onnx_chunk.runtime.caches import variant_pool

    model = GraphRunsModel()
    original = ort.InferenceSession.run_with_iobinding

    def run(self, iobinding, run_options=None):
        model.run(self, None if run_options is None
                  else int(run_options.get_run_config_entry("gpu_graph_id")))
        return original(self, iobinding, run_options)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", run)
    monkeypatch.setattr(ort.InferenceSession, "release_captured_graph",
                        lambda self, graph: model.release(self, graph))
    monkeypatch.setattr(variant_pool, "session_captures", lambda session: True)
    monkeypatch.setattr(cuda_graphs, "releases_graphs", lambda session: model.releases)
    return model
