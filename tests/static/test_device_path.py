"""The static runner on device buffers, run on CPU marked not host-visible (as CUDA looks):
the KV cache stays on the device (bound in place, or rolled device to device), the tokens and
logits equal the host path's, and a decode step moves a logits row, never the cache."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest

from onnx_chunk.runtime.device.buffers import DeviceBuffer
from onnx_chunk.runtime.device.provider import device_for
from onnx_chunk.static.runner import StaticRunner

from .static_sizes import CAPACITY, CHUNK, MAX_INPUT, SEED

DEVICE_LIKE = dataclasses.replace(device_for("cpu"), host_visible=False)


@pytest.fixture(scope="module", params=["rolling", "bound"])
def pair(request, static_models, fixed_pair):
    """(chunk graph, decode graph) of each cache layout."""
    if request.param == "rolling":
        return static_models(CHUNK, CAPACITY, SEED), static_models(1, CAPACITY, SEED)
    return fixed_pair / "chunk.onnx", fixed_pair / "decode.onnx"


def _prompt(length: int) -> list[int]:
    return np.random.default_rng(length).integers(3, 256, length).tolist()


@pytest.mark.parametrize("length, new_tokens", [(1, 8), (6, 8), (14, 20)])
def test_the_device_path_gives_the_host_paths_tokens_and_logits(pair, length, new_tokens):
    host = StaticRunner(*pair, max_input_len=MAX_INPUT, provider="cpu")
    device = StaticRunner(*pair, max_input_len=MAX_INPUT, device=DEVICE_LIKE)
    if host.layout.value == "bound":  # a cache bound at capacity refuses to slide
        new_tokens = min(new_tokens, CAPACITY - length + 1)
    prefill = device.start(_prompt(length), new_tokens)
    assert all(buffer.host is None for buffer in (*prefill.cache.key_buffers,
                                                  *prefill.cache.value_buffers))
    ours = device.decode(prefill, new_tokens, keep_logits=True)
    theirs = host.decode(host.start(_prompt(length), new_tokens), new_tokens, keep_logits=True)
    assert ours.tokens == theirs.tokens
    assert ours.dropped_positions == theirs.dropped_positions  # (14, 20) slides past C
    for mine, reference in zip(ours.step_logits, theirs.step_logits, strict=True):
        np.testing.assert_array_equal(mine, reference)


class _Traffic:
    """Bytes that cross between the host and device memory, by the Python-side API calls
    that can move them."""

    def __init__(self, monkeypatch) -> None:
        self.to_device = self.to_host = 0
        read, write = DeviceBuffer.read, DeviceBuffer.write
        numpy, update = ort.OrtValue.numpy, ort.OrtValue.update_inplace
        bind_cpu = ort.IOBinding.bind_cpu_input
        run = ort.InferenceSession.run

        def counted_read(buffer, start, count, out=None):
            self.to_host += count * buffer.dtype.itemsize
            return read(buffer, start, count, out)

        def counted_write(buffer, array):
            self.to_device += np.asarray(array).nbytes
            return write(buffer, array)

        def counted_numpy(value):
            array = numpy(value)
            self.to_host += array.nbytes
            return array

        def counted_update(value, array):
            self.to_device += array.nbytes
            return update(value, array)

        def counted_bind(binding, name, array):
            self.to_device += array.nbytes
            return bind_cpu(binding, name, array)

        def counted_run(session, names, feeds, *args, **kwargs):
            self.to_device += sum(np.asarray(array).nbytes for array in feeds.values())
            outputs = run(session, names, feeds, *args, **kwargs)
            self.to_host += sum(array.nbytes for array in outputs)
            return outputs

        monkeypatch.setattr(ort.InferenceSession, "run", counted_run)
        monkeypatch.setattr(DeviceBuffer, "read", counted_read)
        monkeypatch.setattr(DeviceBuffer, "write", counted_write)
        monkeypatch.setattr(ort.OrtValue, "numpy", counted_numpy)
        monkeypatch.setattr(ort.OrtValue, "update_inplace", counted_update)
        monkeypatch.setattr(ort.IOBinding, "bind_cpu_input", counted_bind)


def test_a_decode_step_moves_a_logits_row_and_its_inputs_never_the_cache(pair, monkeypatch):
    runner = StaticRunner(*pair, max_input_len=MAX_INPUT, device=DEVICE_LIKE)
    new_tokens = 8
    prefill = runner.start(_prompt(6), new_tokens)
    cache = prefill.cache
    kv_bytes = sum(buffer.nbytes for buffer in (*cache.key_buffers, *cache.value_buffers))
    addresses = {buffer.value.data_ptr() for buffer in (*cache.key_buffers,
                                                        *cache.value_buffers)}
    traffic = _Traffic(monkeypatch)
    before = runner.device.transfers.snapshot()
    result = runner.decode(prefill, new_tokens)
    after = runner.device.transfers.snapshot()
    steps = result.decode_steps
    assert steps == new_tokens - 1
    # Each step reads one logits row back, and writes its token, position and mask into the
    # inputs' device buffers (the runner's own count, and every host copy this test sees).
    to_host = after.device_to_host_bytes - before.device_to_host_bytes
    to_device = after.host_to_device_bytes - before.host_to_device_bytes
    assert to_host == traffic.to_host == steps * runner.vocab_size * 4
    mask_row = 8 * CAPACITY  # float32 [1, 1, 1, C] or int64 [1, C]
    assert 0 < to_device <= traffic.to_device <= 2 * steps * (8 + 8 + mask_row)
    assert to_device <= steps * (8 + 8 + mask_row)
    assert after.synchronizations - before.synchronizations == steps
    assert kv_bytes > 4 * (to_device + to_host) / steps  # the cache never moved
    # The cache was allocated once: bound in place, or rolled between two buffers.
    after = {buffer.value.data_ptr() for buffer in (*cache.key_buffers, *cache.value_buffers)}
    assert after == addresses if runner.layout.value == "bound" else len(after) == len(addresses)
