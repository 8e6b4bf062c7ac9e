"""The logical length beside fixed-capacity KV: room, a forward's end, advance, rewind."""

import pytest

from onnx_chunk.errors import CapacityError, ConfigError, InputError
from onnx_chunk.runtime.engine.kv_state import LogicalLength


def test_room_and_capacity_errors_carry_the_numbers():
    state = LogicalLength(8)
    state.advance(5)
    assert state.room == 3
    state.check_room(3)
    with pytest.raises(CapacityError,
                       match=r"needs 4 positions .* holds 5 of its 8-position .*3 left"):
        state.check_room(4)
    assert state.end(3) == 8
    with pytest.raises(CapacityError, match="ends at 9, past the KV capacity 8"):
        state.end(4)
    with pytest.raises(CapacityError):
        state.advance(4)
    assert state.length == 5


def test_rewind_bounds():
    state = LogicalLength(8)
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
        LogicalLength(0)
