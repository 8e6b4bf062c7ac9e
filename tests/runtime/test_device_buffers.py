"""The device-memory code path (no host view of OrtValues), exercised on the CPU provider.

A CUDA device has no host view of its buffers; the runtime then allocates OrtValues with
ortvalue_from_shape_and_type, reads logits through OrtValue.numpy() and uses the capacity-wide
mask. Declaring the CPU device not host-visible runs exactly that code here.
"""

import dataclasses

import numpy as np
import pytest

from onnx_chunk.runtime import load
from onnx_chunk.runtime import model as runtime_model
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for

PROMPT = np.random.default_rng(5).integers(0, 256, 45).tolist()


@pytest.fixture
def device_like(monkeypatch):
    device = dataclasses.replace(device_for("cpu"), host_visible=False,
                                 mask_policy=MaskPolicy.CAPACITY)
    monkeypatch.setattr(runtime_model, "resolve_device", lambda *args: device)
    return device


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_device_memory_path_gives_the_host_path_results(reference_model, device_like, variant):
    path = reference_model(variant)
    runtime = load(path, provider="cpu", capacity=96, chunk_size=16)
    assert runtime.device is device_like
    sequence = runtime.open_sequence()
    assert all(buffer.host is None for buffer in sequence.buffers.kv)
    assert all(value.data_ptr() != 0 for value in runtime.weights.values)
    logits = sequence.prefill(PROMPT, all_logits=variant == "base")
    tokens = sequence.generate([7, 8], 4)
    reference = load(path, provider="cpu", capacity=96, chunk_size=16).open_sequence()
    assert np.array_equal(logits, reference.prefill(PROMPT, all_logits=variant == "base"))
    assert tokens == reference.generate([7, 8], 4)
