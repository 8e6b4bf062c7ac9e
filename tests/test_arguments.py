"""The edge checks of public arguments: ints are ints, in range; token ids within a vocabulary."""

import numpy as np
import pytest

from onnx_chunk.arguments import integer, optional_integer, token_ids
from onnx_chunk.errors import ConfigError, InputError


@pytest.mark.parametrize("value", [3, np.int64(3), np.uint8(3), np.int32(3)])
def test_integers_and_numpy_integers_pass_as_int(value):
    result = integer(value, "n", minimum=0, maximum=3)
    assert result == 3 and type(result) is int


@pytest.mark.parametrize("value", [True, np.bool_(True), 2.0, 2.5, "2", b"2", None, [2],
                                   np.array(2), np.float32(2)])
def test_anything_else_is_refused_with_its_name(value):
    with pytest.raises(InputError, match="n must be an integer"):
        integer(value, "n")


def test_the_range_is_checked_and_the_error_type_is_the_callers():
    with pytest.raises(InputError, match="at least 1, got 0"):
        integer(0, "n", minimum=1)
    with pytest.raises(ConfigError, match="at most 4, got 5"):
        integer(5, "n", maximum=4, error=ConfigError)


def test_none_means_the_default():
    assert optional_integer(None, "n", minimum=1) is None
    assert optional_integer(np.int16(7), "n", minimum=1) == 7
    with pytest.raises(ConfigError):
        optional_integer(1.5, "n", error=ConfigError)


@pytest.mark.parametrize("value, expected", [
    (2, (2,)), (np.int64(2), (2,)), ([1, 2], (1, 2)), ((0, 9), (0, 9)), ([], ()),
    (np.array([3, 4]), (3, 4)), (np.array(5), (5,)),
])
def test_token_ids_take_one_id_or_a_sequence(value, expected):
    assert token_ids(value, "eos", vocab_size=10) == expected


@pytest.mark.parametrize("value", [-1, 10, "2", b"2", 2.0, 1e30, True, [1, 10], ["1"], [1.0]])
def test_token_ids_outside_the_vocabulary_or_not_ints_are_refused(value):
    with pytest.raises(InputError, match="eos"):
        token_ids(value, "eos", vocab_size=10)
