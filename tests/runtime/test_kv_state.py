"""The logical length beside fixed-capacity KV: mask per policy, room, advance, rewind."""

import numpy as np
import pytest

from onnx_chunk.errors import CapacityError, ConfigError, InputError
from onnx_chunk.runtime.kv_state import LogicalLength
from onnx_chunk.runtime.provider import MaskPolicy


def test_logical_mask_is_a_view_as_wide_as_past_plus_rows():
    state = LogicalLength(10, MaskPolicy.LOGICAL)
    state.advance(3)
    mask = state.mask_for(4)
    assert mask.shape == (1, 7) and mask.sum() == 7
    assert np.shares_memory(mask, state.mask_for(1))
    assert mask.flags.c_contiguous


@pytest.mark.parametrize("steps", [[3, 4, 1], [10], [1, 1, 1, 1]])
def test_capacity_mask_has_ones_for_the_valid_prefix_and_zeros_after(steps):
    state = LogicalLength(10, MaskPolicy.CAPACITY)
    for rows in steps:
        mask = state.mask_for(rows)
        end = state.length + rows
        assert mask.shape == (1, 10)
        assert mask[0, :end].all() and not mask[0, end:].any()
        state.advance(rows)


def test_capacity_mask_clears_columns_after_a_rewind():
    state = LogicalLength(8, MaskPolicy.CAPACITY)
    state.mask_for(6)
    state.advance(6)
    state.rewind(4)
    mask = state.mask_for(1)
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0, 0, 0]]


def test_room_and_capacity_errors_carry_the_numbers():
    state = LogicalLength(8, MaskPolicy.LOGICAL)
    state.advance(5)
    assert state.room == 3
    state.check_room(3)
    with pytest.raises(CapacityError,
                       match=r"needs 4 positions .* holds 5 of its 8-position .*3 left"):
        state.check_room(4)
    with pytest.raises(CapacityError):
        state.mask_for(4)
    with pytest.raises(CapacityError):
        state.advance(4)
    assert state.length == 5


def test_rewind_bounds():
    state = LogicalLength(8, MaskPolicy.LOGICAL)
    state.advance(5)
    state.rewind(2)
    assert state.length == 3
    with pytest.raises(InputError, match="0 to 3"):
        state.rewind(4)
    with pytest.raises(InputError):
        state.rewind(-1)
    state.rewind(3)
    assert state.length == 0


def test_capacity_must_be_positive():
    with pytest.raises(ConfigError):
        LogicalLength(0, MaskPolicy.LOGICAL)
