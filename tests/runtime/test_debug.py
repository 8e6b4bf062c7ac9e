"""onnx_chunk.runtime.debug: the stand-ins a script uses replace what the runtime reads only
inside their block, and fail loudly when what they replace has moved."""

import contextlib
import dataclasses

import pytest

import onnx_chunk
from onnx_chunk.runtime import MaskPolicy, debug
from onnx_chunk.runtime.caches import variant_pool
from onnx_chunk.runtime.engine import plan_runner


def _never(widths, slots):
    return False


@pytest.mark.parametrize("stand_in, module, name, check", [
    (debug.sessions_count_as_capturing, variant_pool, "session_captures",
     lambda replaced: replaced(object()) is True),
    (lambda: debug.prefill_batching(_never), plan_runner, "batch_pays",
     lambda replaced: replaced is _never),
])
def test_a_stand_in_replaces_inside_its_block_only(stand_in, module, name, check):
    original = getattr(module, name)
    with stand_in():
        assert check(getattr(module, name))
    assert getattr(module, name) is original
    with pytest.raises(RuntimeError), stand_in():
        raise RuntimeError("a failing step")
    assert getattr(module, name) is original


def test_a_stand_in_whose_target_moved_fails_at_once(monkeypatch):
    monkeypatch.delattr(variant_pool, "session_captures")
    with pytest.raises(AttributeError), debug.sessions_count_as_capturing():
        pass
    assert not hasattr(variant_pool, "session_captures")


def test_the_capture_stand_in_counts_a_cpu_session_as_capturing(reference_model):
    """The dry run of a GPU check: the CPU device dressed as CUDA captures (in the runtime's
    bookkeeping) only inside the block."""
    device = dataclasses.replace(debug.device_for("cpu"), host_visible=False,
                                 mask_policy=MaskPolicy.CAPACITY, cuda_graphs=True)
    captured = {}
    for inside in (True, False):
        stand_in = (debug.sessions_count_as_capturing() if inside
                    else contextlib.nullcontext())
        with stand_in, onnx_chunk.load(reference_model(), device=device, capacity=64,
                                       chunk_size=16) as runtime:
            runtime.open_sequence().generate([1, 2, 3, 4, 5], 4, eos_token_id=[])
            captured[inside] = runtime.stats.graphs_captured
    assert captured[True] > 0 and captured[False] == 0

