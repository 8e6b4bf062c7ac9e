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

    It counts the runs per (session, gpu_graph_id) as the CUDA provider does (the run after
    RUNS_BEFORE_CAPTURE of them captures, later ones replay) and records every
    release_captured_graph; `alive` holds the graphs captured and not released. `violations`
    lists what ONNX Runtime would not allow: a capture beside another forward, a run of a
    released graph id, a release of a graph never captured. `delay` (seconds) keeps each run in
    flight a while, so that runs of several threads overlap.
    """

    def __init__(self) -> None:
        self.runs: list[tuple[int, int | None]] = []
        self.counts: dict[tuple[int, int], int] = {}
        self.alive: set[tuple[int, int]] = set()
        self.gone: set[tuple[int, int]] = set()
        self.released: list[int] = []
        self.captures: list[tuple[int, int]] = []
        self.peak_alive = 0
        self.violations: list[str] = []
        self.delay = 0.0
        self._in_flight = 0
        self._lock = threading.Lock()

    def run(self, session, graph: int | None) -> None:
        key = (id(session), graph)
        with self._lock:
            self.runs.append(key)
            self._in_flight += 1
            if graph is not None and graph != cuda_graphs.SKIP_CAPTURE:
                if key in self.gone:
                    self.violations.append(f"graph {graph} ran after its release")
                count = self.counts[key] = self.counts.get(key, 0) + 1
                if count == cuda_graphs.RUNS_BEFORE_CAPTURE + 1:
                    self.captures.append(key)
                    self.alive.add(key)
                    self.peak_alive = max(self.peak_alive, len(self.alive))
                    if self._in_flight > 1:
                        self.violations.append(f"graph {graph} captured beside another run")
        try:
            time.sleep(self.delay)
        finally:
            with self._lock:
                self._in_flight -= 1

    def release(self, session, graph: int) -> None:
        key = (id(session), graph)
        with self._lock:
            self.released.append(graph)
            if key not in self.alive:
                self.violations.append(f"graph {graph} released but never captured")
            self.alive.discard(key)
            self.gone.add(key)



@pytest.fixture
def graph_model(monkeypatch):
    """`GraphRunsModel` around every run_with_iobinding and release_captured_graph, with every
    session counted as capturing (CPU sessions never capture)."""
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
    return model
