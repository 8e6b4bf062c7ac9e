"""docs/cuda.md's promises that no other test holds it to, run on CPU (the device-memory path:
the CPU device marked not host-visible)."""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading

import numpy as np
import onnxruntime as ort
import pytest

from onnx_chunk.runtime import load
from onnx_chunk.runtime.caches import cuda_graphs
from onnx_chunk.runtime.device import allocation
from onnx_chunk.runtime.device.allocation import ALLOCATIONS
from onnx_chunk.runtime.device.buffers import device_zeros
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for
from tests.exports.corpus import ROOT as CORPUS
from tests.runtime.test_device_path import batched_transfers

DEVICE = dataclasses.replace(device_for("cpu"), host_visible=False,
                             mask_policy=MaskPolicy.CAPACITY)


@pytest.fixture
def fresh_fallback_note():
    allocation.note_fallback.cache_clear()
    yield
    allocation.note_fallback.cache_clear()


def test_without_from_dlpack_the_buffer_comes_from_onnx_runtime(monkeypatch,
                                                                fresh_fallback_note):
    monkeypatch.delattr(ort.OrtValue, "from_dlpack")
    gc.collect()
    before = ALLOCATIONS.live_bytes
    buffer = device_zeros((2, 8), np.float32, DEVICE)
    assert ALLOCATIONS.live_bytes == before  # not the runtime's own allocation
    assert buffer.read(0, 16).tolist() == [0.0] * 16


def test_a_refused_dlpack_import_falls_back_with_one_warning(monkeypatch, caplog,
                                                             fresh_fallback_note):
    def refuse(capsule):
        raise RuntimeError("no DLPack here")

    monkeypatch.setattr(ort.OrtValue, "from_dlpack", staticmethod(refuse))
    gc.collect()
    before = ALLOCATIONS.live_bytes
    with caplog.at_level(logging.WARNING):
        buffers = [device_zeros((4,), np.int64, DEVICE) for _ in range(3)]
    assert ALLOCATIONS.live_bytes == before
    assert all(buffer.read(0, 4).tolist() == [0] * 4 for buffer in buffers)
    warnings = [record for record in caplog.records if "from_dlpack" in record.getMessage()]
    assert len(warnings) == 1


class _CudaSession:
    """What release_graphs sees of a CUDA session: its providers; records release calls."""

    def __init__(self) -> None:
        self.released: list[int] = []

    def get_providers(self):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def release_captured_graph(self, graph):
        self.released.append(graph)


def test_no_release_call_and_no_warning_on_cuda(monkeypatch, caplog):
    assert cuda_graphs.RELEASING_PROVIDERS == frozenset()  # "none today"
    monkeypatch.setattr(cuda_graphs, "release_method", lambda: True)  # ONNX Runtime 1.27+
    session = _CudaSession()
    with caplog.at_level(logging.WARNING):
        assert cuda_graphs.release_graphs(session, (1, 2, 3)) == 0
    assert session.released == [] and not caplog.records




@pytest.mark.parametrize("model", ["conv_hybrid", "genai-gemma2-fp32"])
def test_state_and_window_rows_never_cross_in_a_batched_decode(reference_model, model):
    """Slot state rows, idle rows' state and window-cache rows are copied device to device:
    a batched step sends its tokens and positions and reads a logits row per row, no more."""
    path = reference_model(model) if model == "conv_hybrid" else CORPUS / model / "model.onnx"
    runtime = load(path, device=DEVICE, capacity=96, chunk_size=16, max_batch=3)
    ports = runtime.debug.ports
    windowed = any(binding.window for binding in runtime.debug.plan.capacity_inputs)
    assert ports.state if model == "conv_hybrid" else windowed
    row_in = np.dtype(ports.token_dtype).itemsize * (ports.hidden_size or 1) + 8
    row_out = ports.vocab_size * np.dtype(ports.logits_dtype).itemsize
    prompts = [list(range(5 + i, 30 + 7 * i)) for i in range(3)]
    seen = batched_transfers(runtime, prompts)
    assert seen
    for sent, received, rows in seen:
        assert sent <= rows * row_in and received == rows * row_out
    runtime.close()


def test_the_batch_engine_captures_and_replays_from_its_own_thread(reference_model,
                                                                   graph_model, monkeypatch):
    from tests.cuda.test_graph_cache import GRAPH_DEVICE

    runtime = load(reference_model(), device=GRAPH_DEVICE, capacity=96, chunk_size=16,
                   max_batch=2)
    threads = []
    wrapped = ort.InferenceSession.run_with_iobinding

    def run(self, iobinding, run_options=None):
        if self in graph_model.sessions:  # the model's forwards (not the device's probe)
            threads.append(threading.get_ident())
        return wrapped(self, iobinding, run_options)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", run)
    graph_model.runs.clear()
    prompts = [list(range(3, 30)), list(range(40, 52))]
    requests = [runtime.submit(prompt, 6) for prompt in prompts]
    assert all(len(request.result(timeout=60)) == 6 for request in requests)
    captured = [graph for _, graph in graph_model.runs if graph not in (None, -1)]
    assert captured and graph_model.captures and not graph_model.violations
    assert len(set(threads)) == 1 and threads[0] != threading.get_ident()
    runtime.close()
