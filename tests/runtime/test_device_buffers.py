"""The device-memory code path (no host view of OrtValues), exercised on the CPU provider.

A CUDA device has no host view of its buffers; the runtime then allocates its buffers itself
(`allocation.owned_zeros`: OrtValues over memory of exactly their size, through DLPack, freed
with their last user), reads logits by partial copies and uses the capacity-wide mask.
Declaring the CPU device not host-visible runs exactly that code here (malloc for cudaMalloc).
"""

import dataclasses
import gc

import numpy as np
import pytest

from onnx_chunk.errors import ConfigError
from onnx_chunk.runtime import facade, load
from onnx_chunk.runtime.device.allocation import ALLOCATIONS
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for
from onnx_chunk.runtime.device.session_factory import ARENA_SHRINKAGE_KEY, SessionFactory

PROMPT = np.random.default_rng(5).integers(0, 256, 45).tolist()


@pytest.fixture
def device_like(monkeypatch):
    device = dataclasses.replace(device_for("cpu"), host_visible=False,
                                 mask_policy=MaskPolicy.CAPACITY)
    monkeypatch.setattr(facade, "resolve_device", lambda *args: device)
    return device


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_device_memory_path_gives_the_host_path_results(reference_model, device_like, variant):
    path = reference_model(variant)
    runtime = load(path, provider="cpu", capacity=96, chunk_size=16)
    assert runtime.debug.device is device_like
    sequence = runtime.open_sequence()
    assert all(buffer.host is None for buffer in sequence.buffers.kv)
    assert all(value.data_ptr() != 0 for value in runtime.debug.weights.values)
    logits = sequence.prefill(PROMPT, all_logits=variant == "base")
    tokens = sequence.generate([7, 8], 4)
    reference = load(path, provider="cpu", capacity=96, chunk_size=16).open_sequence()
    assert np.array_equal(logits, reference.prefill(PROMPT, all_logits=variant == "base"))
    assert tokens == reference.generate([7, 8], 4)


def test_close_gives_the_buffers_back_and_a_second_runtime_inherits_nothing(reference_model,
                                                                            device_like):
    path = reference_model()
    gc.collect()
    before = ALLOCATIONS.live_bytes
    held = []
    for _ in range(2):
        runtime = load(path, provider="cpu", capacity=96, chunk_size=16, max_batch=2)
        sequence = runtime.open_sequence()
        sequence.generate(PROMPT, 4)
        # One prompt: with two, the buffers the engine's forwards bind depend on whether the
        # second arrived before the first's prefill ran (the engine steps in its own thread).
        runtime.generate_many([PROMPT], 3, eos_token_id=[])
        held.append(ALLOCATIONS.live_bytes - before)
        # KV of the sequence and of the engine's two slots, at least, in buffers of their own.
        assert held[-1] >= 3 * sequence.stats.kv_bytes
        runtime.close()
        del runtime, sequence
        gc.collect()
        assert ALLOCATIONS.live_bytes == before
    assert held[0] == held[1]


def test_arena_shrinkage_is_refused_as_a_session_option(reference_model, device_like):
    # A run option (onnxruntime_run_options_config_keys.h): as a session option ONNX Runtime
    # would ignore it, with graphs on or off.
    for device in (dataclasses.replace(device_like, cuda_graphs=True), device_like):
        with pytest.raises(ConfigError, match=f"{ARENA_SHRINKAGE_KEY} is an ONNX Runtime run "
                           "option"):
            SessionFactory(reference_model(), None, device, query_dim=None, fixed_dims={},
                           session_config={ARENA_SHRINKAGE_KEY: "gpu:0"})
