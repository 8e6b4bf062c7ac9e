"""The resident range of a window-sized KV cache, against a step-by-step simulation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onnx_chunk.errors import ConfigError
from onnx_chunk.runtime.engine.kv_window import resident_rows, rewind_is_exact


def _simulate(total: int, capacity: int, window: int) -> int:
    """One position at a time: when a new position finds the buffer full, evict the oldest
    positions so that exactly the window stays (capacity - window + 1 reclaimed at once)."""
    held = 0
    for _ in range(total):
        if held == capacity:
            held -= capacity - window + 1
        held += 1
    return held


@given(window=st.integers(1, 40), slack=st.integers(0, 40), total=st.integers(0, 400))
def test_resident_rows_match_the_step_by_step_eviction(window, slack, total):
    capacity = window + slack
    held = resident_rows(total, capacity, window)
    assert held == _simulate(total, capacity, window)
    assert min(total, window) <= held <= min(total, capacity)


def test_a_rewind_across_an_eviction_is_not_exact():
    # capacity 8, window 4: the 9th position evicts 5, leaving 4.
    assert resident_rows(9, 8, 4) == 4
    assert rewind_is_exact(8, 3, 8, 4)
    assert not rewind_is_exact(9, 1, 8, 4)
    assert rewind_is_exact(10, 1, 8, 4)


@pytest.mark.parametrize("capacity, window", [(3, 4), (4, 0)])
def test_an_impossible_cache_is_refused(capacity, window):
    with pytest.raises(ConfigError):
        resident_rows(1, capacity, window)
