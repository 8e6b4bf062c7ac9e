"""docs/cuda.md: the static runner writes its inputs into device buffers allocated once (the
device-memory path: the CPU device marked not host-visible)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from onnx_chunk.runtime.device.provider import device_for
from onnx_chunk.static import graphs as static_graphs
from onnx_chunk.static.runner import StaticRunner

from .static_sizes import CAPACITY, CHUNK, MAX_INPUT, SEED

DEVICE_LIKE = dataclasses.replace(device_for("cpu"), host_visible=False)


@pytest.fixture(scope="module", params=["rolling", "bound"])
def pair(request, static_models, fixed_pair):
    if request.param == "rolling":
        return static_models(CHUNK, CAPACITY, SEED), static_models(1, CAPACITY, SEED)
    return fixed_pair / "chunk.onnx", fixed_pair / "decode.onnx"


def test_the_input_buffers_are_allocated_once(pair, monkeypatch):
    allocated = []
    original = static_graphs.device_zeros

    def counted(shape, dtype, device):
        allocated.append(tuple(shape))
        return original(shape, dtype, device)

    monkeypatch.setattr(static_graphs, "device_zeros", counted)
    runner = StaticRunner(*pair, max_input_len=MAX_INPUT, device=DEVICE_LIKE)
    prompts = [np.random.default_rng(n).integers(3, 256, n).tolist() for n in (6, 9)]
    first = runner.decode(runner.start(prompts[0], 8), 8)
    after_first = len(allocated)
    assert first.decode_steps == 7 and after_first > 0
    runner.decode(runner.start(prompts[1], 8), 8)
    # The second request writes into the first one's buffers: nothing is allocated.
    assert allocated[after_first:] == []
