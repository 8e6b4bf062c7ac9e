"""The device-memory path (the CPU marked not host-visible, as CUDA looks): two threads on
per-width variants, partial mask writes, and shared weights ONNX Runtime would refuse."""

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest

from onnx_chunk.errors import ModelLoadError
from onnx_chunk.runtime import facade, load
from onnx_chunk.runtime.device.buffers import device_zeros
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for
from onnx_chunk.runtime.device.session_factory import SessionFactory, SharedWeights
from onnx_chunk.runtime.device.transfers import TransferStats

from .test_requests import generate_in_threads

DEVICE_LIKE = dataclasses.replace(device_for("cpu"), host_visible=False,
                                  mask_policy=MaskPolicy.CAPACITY, specialize=True)


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_two_threads_on_per_width_variants_on_the_device_path(reference_model, monkeypatch,
                                                              variant):
    monkeypatch.setattr(facade, "resolve_device", lambda *args: DEVICE_LIKE)
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


def _device(**changes):
    """A fresh device-like CPU device (its own transfer counters), graphs off."""
    return dataclasses.replace(device_for("cpu"), host_visible=False,
                               mask_policy=MaskPolicy.CAPACITY, **changes)


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_a_decode_step_moves_its_inputs_in_and_one_logits_row_out(reference_model, variant):
    runtime = load(reference_model(variant), device=_device(), capacity=96, chunk_size=16)
    ports = runtime.debug.ports
    vocab, logits_size = ports.vocab_size, np.dtype(ports.logits_dtype).itemsize
    mask_column = np.dtype(ports.mask_dtype).itemsize
    token = np.dtype(ports.token_dtype).itemsize * (ports.hidden_size or 1)
    positions = 8 if ports.position_ids is not None else 0
    sequence = runtime.open_sequence()
    before = runtime.stats.transfers
    sequence.prefill(list(range(3, 48)))  # 45 = 16 + 16 + 13 (padded to a tier)
    after = runtime.stats.transfers
    # Prefill: one logits row, at the last chunk (and a model with recurrent state reads its
    # state once per prefill call: what a prefill that fails partway puts back); in: per
    # chunk its tokens, positions and the logits row index (the mask is set on the device).
    state = sum(int(np.prod(port.shape)) * np.dtype(port.dtype).itemsize
                for port in ports.state)
    assert after.device_to_host_bytes - before.device_to_host_bytes == (
        vocab * logits_size + state)
    chunks = sequence.stats.last_generation.chunks if sequence.stats.last_generation else None
    widths = [16, 16, 16] if chunks is None else [chunk.width for chunk in chunks]
    bound = sum(width * (token + positions + mask_column) + 8 for width in widths)
    assert 0 < after.host_to_device_bytes - before.host_to_device_bytes <= bound
    for step in range(5):
        before = runtime.stats.transfers
        sequence.decode(7 + step)
        after = runtime.stats.transfers
        sent = after.host_to_device_bytes - before.host_to_device_bytes
        assert sent <= token + positions + mask_column, step
        assert sent == token + positions  # the mask column is set on the device
        assert after.device_to_host_bytes - before.device_to_host_bytes == vocab * logits_size
        assert after.synchronizations - before.synchronizations == 1


def batched_transfers(runtime, prompts) -> list[tuple[int, int, int]]:
    """(host-to-device bytes, device-to-host bytes, rows) of every batched forward while
    `runtime` generates 6 tokens for each of `prompts` (through the one forward,
    `ModelRunner.run`)."""
    runner, seen = runtime.debug.runner, []
    original = type(runner).run

    def run(self, slot, forward):
        before = runtime.stats.transfers
        ran = original(self, slot, forward)
        after = runtime.stats.transfers
        if len(forward.rows) > 1:
            seen.append((after.host_to_device_bytes - before.host_to_device_bytes,
                         after.device_to_host_bytes - before.device_to_host_bytes,
                         len(forward.rows)))
        return ran

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(runner), "run", run)
        runtime.generate_many(prompts, 6, eos_token_id=[])
    return seen


def test_a_batched_decode_step_moves_one_row_per_sequence(reference_model):
    runtime = load(reference_model("base"), device=_device(), capacity=96, chunk_size=16,
                   max_batch=4)
    ports = runtime.debug.ports
    vocab, logits_size = ports.vocab_size, np.dtype(ports.logits_dtype).itemsize
    # Tokens and positions; mask updates never cross (they are made on the device).
    per_row = np.dtype(ports.token_dtype).itemsize + 8
    seen = batched_transfers(runtime, [list(range(1 + i, 20 + 3 * i)) for i in range(4)])
    assert seen
    for sent, received, rows in seen:
        # Tokens and positions in (within the one mask column per row allowed); one logits
        # row per row out.
        assert sent <= rows * per_row
        assert received == rows * vocab * logits_size
    runtime.close()


def test_the_host_path_moves_nothing(reference_model):
    runtime = load(reference_model("base"), provider="cpu", capacity=96, chunk_size=16)
    runtime.open_sequence().generate(list(range(3, 30)), 4)
    assert runtime.stats.transfers == TransferStats()
