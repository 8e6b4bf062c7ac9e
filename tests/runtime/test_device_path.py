"""The device-memory path (the CPU marked not host-visible, as CUDA looks): two threads on
per-width variants, partial mask writes, and shared weights ONNX Runtime would refuse."""

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest

from onnx_chunk.errors import ModelLoadError
from onnx_chunk.runtime import load
from onnx_chunk.runtime import model as runtime_model
from onnx_chunk.runtime.device.buffers import device_zeros
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for
from onnx_chunk.runtime.device.session_factory import SessionFactory, SharedWeights

from .test_requests import generate_in_threads

DEVICE_LIKE = dataclasses.replace(device_for("cpu"), host_visible=False,
                                  mask_policy=MaskPolicy.CAPACITY, specialize=True)


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_two_threads_on_per_width_variants_on_the_device_path(reference_model, monkeypatch,
                                                              variant):
    monkeypatch.setattr(runtime_model, "resolve_device", lambda *args: DEVICE_LIKE)
    runtime = load(reference_model(variant), provider="cpu", capacity=96, chunk_size=16,
                   max_variants=3)
    prompts = [list(range(1, 40)), list(range(100, 121))]
    alone = [runtime.open_sequence().generate(prompt, 5) for prompt in prompts]
    results, errors = generate_in_threads(runtime, prompts, rounds=3, new_tokens=5)
    assert not errors
    assert results[0] == [alone[0]] * 3 and results[1] == [alone[1]] * 3
    assert runtime.stats.cache.peak_variants <= 3


def test_weights_that_onnxruntime_owns_are_refused_with_a_clear_error(reference_model):
    owned = ort.OrtValue.ortvalue_from_shape_and_type([2], np.float32, "cpu", 0)
    weights = SharedWeights(("w",), (owned,), 8)
    factory = SessionFactory(reference_model("base"), weights, device_for("cpu"),
                             query_dim="sequence_length", fixed_dims={})
    with pytest.raises(ModelLoadError, match="refuses the shared weights"):
        factory.create(None, prepack=False)


@pytest.mark.parametrize("host_visible", [True, False])
def test_write_range_writes_only_the_range(host_visible):
    device = dataclasses.replace(device_for("cpu"), host_visible=host_visible)
    buffer = device_zeros((1, 8), np.int64, device)
    source = np.arange(8, dtype=np.int64).reshape(1, 8)
    buffer.write_range(source, 2, 5)
    assert buffer.read(0, 8).tolist() == [0, 0, 2, 3, 4, 0, 0, 0]
    buffer.write_range(source, 5, 5)
    assert buffer.read(0, 8).tolist() == [0, 0, 2, 3, 4, 0, 0, 0]


def test_reads_off_the_host_can_reuse_one_row_buffer():
    device = dataclasses.replace(device_for("cpu"), host_visible=False)
    buffer = device_zeros((1, 2, 4), np.float32, device)
    buffer.write(np.arange(8, dtype=np.float32).reshape(1, 2, 4))
    row = np.empty(4, dtype=np.float32)
    assert buffer.read(4, 4, row) is row
    assert row.tolist() == [4.0, 5.0, 6.0, 7.0]
