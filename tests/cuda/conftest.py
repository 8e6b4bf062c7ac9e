"""Fixtures of the CUDA-path tests (run on CPU)."""

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
