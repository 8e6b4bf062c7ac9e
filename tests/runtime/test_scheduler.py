"""The batch engine's pure rules: the bounded FIFO queue, admission, the prefill budget, the
decode mask and which idle rows a window-sized cache must be protected for."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from onnx_chunk.errors import ConfigError, QueueFullError
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for
from onnx_chunk.runtime.engine.scheduler import RequestQueue, admit, prefill_picks
from onnx_chunk.runtime.runner.attention_mask import decode_mask, mask_kind
from onnx_chunk.runtime.runner.idle_rows import evicting_rows


def test_the_queue_is_fifo_bounded_and_says_when_it_is_full():
    queue = RequestQueue(2)
    queue.push("a")
    queue.push("b")
    assert queue.full and len(queue) == 2
    with pytest.raises(QueueFullError, match="2 requests wait"):
        queue.push("c")
    assert queue.pop() == "a"
    queue.push("c")
    assert queue.remove("c") and not queue.remove("c")
    assert queue.drain() == ["b"] and len(queue) == 0
    with pytest.raises(ConfigError):
        RequestQueue(0)


def test_free_slots_take_waiting_requests_smallest_slot_first():
    assert admit([3, 1, 2], 2) == [1, 2]
    assert admit([0, 1], 5) == [0, 1]
    assert admit([0, 1], 0) == []


def test_prefill_fills_the_budget_in_admission_order_and_never_skips_ahead():
    # Short prompts share one step's budget.
    assert prefill_picks([[5], [4], [6]], 16) == [1, 1, 1]
    # The first chunk that does not fit ends the step: the 3-row prompt behind it waits.
    assert prefill_picks([[5], [16], [3]], 16) == [1, 0, 0]
    # Several chunks of one prompt in one step.
    assert prefill_picks([[4, 4, 4, 4, 1]], 16) == [4]
    # A chunk wider than the budget still runs (the first one always does).
    assert prefill_picks([[32], [1]], 16) == [1, 0]
    assert prefill_picks([], 16) == []
    with pytest.raises(ConfigError):
        prefill_picks([[1]], 0)


@given(st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=4), max_size=6),
       st.integers(1, 64))
def test_prefill_picks_stay_within_the_budget_and_make_progress(pending, budget):
    picks = prefill_picks(pending, budget)
    rows = sum(sum(chunks[:count]) for chunks, count in zip(pending, picks))
    if pending:
        assert picks[0] >= 1
        assert rows <= max(budget, pending[0][0])
    # FIFO: a prompt gets chunks only if every earlier one got all of its chunks.
    for index, count in enumerate(picks):
        if count:
            assert all(picks[before] == len(pending[before]) for before in range(index))


def test_the_decode_mask_gives_each_row_its_own_length_plus_one():
    mask = decode_mask([0, 3, 1], 5, np.int64)
    assert mask.tolist() == [[1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    device = device_for("cpu")
    assert mask_kind(MaskPolicy.LOGICAL)(3, 64, np.int64, device).width([0, 3, 1]) == 4
    assert mask_kind(MaskPolicy.CAPACITY)(3, 64, np.int64, device).width([0, 3, 1]) == 64


def test_idle_rows_are_protected_only_where_one_more_position_would_evict():
    lengths = [47, 48, 10, 0]
    assert evicting_rows(lengths, [0, 1, 2, 3], rows=48, window=32) == [1]
    assert evicting_rows(lengths, [0, 2], rows=48, window=32) == []
    assert evicting_rows(lengths, [1], rows=48, window=None) == []
