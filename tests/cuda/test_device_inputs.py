"""Device-resident step inputs on CPU: bound once at fixed addresses, one logits row to the host.

The CPU device marked not host-visible with the capacity-wide mask runs the CUDA code path:
OrtValues allocated once, written in place, logits read by address range.
"""

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest

from onnx_chunk.runtime import load
from onnx_chunk.runtime.device import buffers
from onnx_chunk.runtime.device.buffers import device_zeros
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for
from onnx_chunk.runtime.state.ports import MASK_INPUT

PROMPT = np.random.default_rng(3).integers(0, 256, 45).tolist()
# The CUDA path's shape on CPU: device memory, the capacity mask, per-width variants.
DEVICE = dataclasses.replace(device_for("cpu"), host_visible=False,
                             mask_policy=MaskPolicy.CAPACITY, specialize=True)


def test_partial_read_copies_only_the_range():
    array = np.arange(24, dtype=np.float32).reshape(1, 4, 6)
    for device in (DEVICE, device_for("cpu")):
        buffer = device_zeros(array.shape, array.dtype, device)
        buffer.write(array)
        assert np.array_equal(buffer.read(6, 12), array.reshape(-1)[6:18])
        assert buffer.read(23, 1)[0] == 23
        with pytest.raises(ValueError):
            buffer.read(20, 5)
    assert buffer.host is not None and np.shares_memory(buffer.read(0, 6), buffer.host)


@pytest.fixture
def copies(monkeypatch):
    """Bytes copied from device buffers to the host, per copy."""
    sizes = []
    original = buffers.copy_to_host

    def copy(value, offset, out):
        sizes.append(out.nbytes)
        return original(value, offset, out)

    monkeypatch.setattr(buffers, "copy_to_host", copy)
    return sizes


def test_only_one_logits_row_reaches_the_host_per_token(reference_model, copies):
    runtime = load(reference_model(), device=DEVICE, capacity=96, chunk_size=16)
    sequence = runtime.open_sequence()
    tokens = sequence.generate(PROMPT, 6)
    row = runtime.stats.vocab_size * np.dtype(runtime.debug.ports.logits_dtype).itemsize
    # 45 tokens at W=16: three prefill forwards, only the last one's last row is read, then
    # one row per decode step.
    assert copies == [row] * len(tokens)
    host = load(reference_model(), provider="cpu", capacity=96, chunk_size=16)
    assert tokens == host.open_sequence().generate(PROMPT, 6)


@pytest.fixture
def bound_inputs(monkeypatch):
    """Per IOBinding, what each of its inputs is bound to now: the OrtValue, or None when it
    was bound by address or from a host array (recorded through IOBinding's own methods)."""
    inputs: dict[ort.IOBinding, dict[str, ort.OrtValue | None]] = {}

    def record(method: str, by_value: bool) -> None:
        original = getattr(ort.IOBinding, method)

        def recorded(self, name, *args, **kwargs):
            inputs.setdefault(self, {})[name] = args[0] if by_value else None
            return original(self, name, *args, **kwargs)

        monkeypatch.setattr(ort.IOBinding, method, recorded)

    record("bind_ortvalue_input", True)
    record("bind_input", False)
    record("bind_cpu_input", False)
    clear = ort.IOBinding.clear_binding_inputs

    def cleared(self):
        inputs.pop(self, None)
        return clear(self)

    monkeypatch.setattr(ort.IOBinding, "clear_binding_inputs", cleared)
    return inputs


@pytest.mark.parametrize("variant", ["base", "conv_hybrid", "position_ids", "inputs_embeds"])
def test_inputs_are_bound_once_at_fixed_addresses(reference_model, variant, bound_inputs):
    runtime = load(reference_model(variant), device=DEVICE, capacity=96, chunk_size=16)
    sequence = runtime.open_sequence()
    sequence.generate(PROMPT, 2)
    with runtime.debug.cache.acquire(1) as session:
        binding = runtime.debug.variants.bindings(session, sequence.slot)[1]
    bound = dict(bound_inputs[binding.io])
    addresses = (binding.tokens.value.data_ptr(), bound[MASK_INPUT].data_ptr(),
                 binding.logits.value.data_ptr(),
                 None if binding.positions is None else binding.positions.value.data_ptr())
    logits = sequence.decode(5)
    for _ in range(3):
        logits = sequence.decode(int(np.argmax(logits)))
    with runtime.debug.cache.acquire(1) as session:
        assert runtime.debug.variants.bindings(session, sequence.slot)[1] is binding
    now = bound_inputs[binding.io]
    assert addresses == (binding.tokens.value.data_ptr(), now[MASK_INPUT].data_ptr(),
                         binding.logits.value.data_ptr(),
                         None if binding.positions is None
                         else binding.positions.value.data_ptr())
    # Every input is an OrtValue (no host pointer bound per run), and apart from the state
    # buffers, which alternate, the very same ones as before the decode steps.
    state_inputs = {port.input for port in runtime.debug.ports.state}
    assert all(value is not None for value in now.values())
    assert {name: value for name, value in now.items() if name not in state_inputs} == \
        {name: value for name, value in bound.items() if name not in state_inputs}
    mask = np.zeros((1, 96), dtype=np.int64)
    mask[0, :sequence.length] = 1
    sequence_mask = now[MASK_INPUT].numpy()
    assert sequence_mask.shape == (1, 96)
    assert np.array_equal(sequence_mask, mask)


def test_logical_mask_on_the_device_path_gives_the_same_tokens(reference_model):
    logical = dataclasses.replace(DEVICE, mask_policy=MaskPolicy.LOGICAL)
    tokens = load(reference_model(), device=logical, capacity=96,
                  chunk_size=16).open_sequence().generate(PROMPT, 5)
    reference = load(reference_model(), device=DEVICE, capacity=96, chunk_size=16)
    assert tokens == reference.open_sequence().generate(PROMPT, 5)
