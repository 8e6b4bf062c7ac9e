"""Per-chunk additive masks: rows of the causal-plus-padding mask, key axis right-aligned to C."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_chunk.errors import ConfigError, InputError
from onnx_chunk.static.mask import chunk_mask, mask_fill_value


def _full_mask(valid: np.ndarray, fill: float) -> np.ndarray:
    n = len(valid)
    allowed = np.tril(np.ones((n, n), dtype=bool)) & valid[None, :]
    return np.where(allowed, 0.0, fill).astype(np.float32)


def test_fill_values_are_half_the_largest_power_of_two():
    assert mask_fill_value(np.float16) == -32768.0
    assert mask_fill_value(np.float32) == -(2.0 ** 127)
    assert mask_fill_value(np.float32) == pytest.approx(np.finfo(np.float32).min / 2, rel=1e-6)
    with pytest.raises(ConfigError):
        mask_fill_value(np.int64)


def test_fill_value_keeps_headroom_where_the_dtype_minimum_overflows():
    with np.errstate(over="ignore"):
        score = np.float16(-100)
        assert np.isinf(np.float16(np.finfo(np.float16).min) + score)
        assert np.isfinite(np.float16(mask_fill_value(np.float16)) + score)


@pytest.mark.parametrize("pads", [0, 3, 5])
def test_chunk_masks_are_the_rows_of_the_full_mask_right_aligned(pads):
    valid = np.array([False] * pads + [True] * (12 - pads))
    fill = mask_fill_value(np.float32)
    full = _full_mask(valid, fill)
    capacity, rows = 16, 4
    for start in range(0, 12, rows):
        mask = chunk_mask(valid, start, rows, capacity)
        assert mask.shape == (1, 1, rows, capacity) and mask.dtype == np.float32
        end = start + rows
        np.testing.assert_array_equal(mask[0, 0, :, capacity - end:], full[start:end, :end])
        assert (mask[0, 0, :, :capacity - end] == fill).all()


def test_overflowing_chunk_keeps_the_last_capacity_keys():
    valid = np.ones(12, dtype=bool)
    mask = chunk_mask(valid, 8, 4, 6)[0, 0]
    # keys are positions 6..11; query 8 sees 6, 7, 8; query 11 sees all six
    open_cells = mask == 0
    assert open_cells.tolist() == [
        [True, True, True, False, False, False],
        [True, True, True, True, False, False],
        [True, True, True, True, True, False],
        [True, True, True, True, True, True],
    ]


def test_a_padding_row_is_fully_masked_finite_but_nan_with_minus_infinity():
    valid = np.array([False, False, True, True])
    mask = chunk_mask(valid, 0, 4, 8)[0, 0]
    assert (mask[0] == mask_fill_value(np.float32)).all()
    scores = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)

    def softmax(x):
        with np.errstate(invalid="ignore"):
            e = np.exp(x - x.max(axis=-1, keepdims=True))
            return e / e.sum(axis=-1, keepdims=True)

    finite = softmax(scores + mask)
    assert np.isfinite(finite).all()
    assert (finite[3, :4] == 0).all()  # masked keys get exactly zero weight in real rows
    infinite = softmax(scores + np.where(mask == 0, 0, -np.inf).astype(np.float32))
    assert np.isnan(infinite[0]).all() and np.isfinite(infinite[2:]).all()


def test_float16_masks_use_the_float16_fill():
    mask = chunk_mask(np.array([False, True]), 0, 2, 4, np.float16)
    assert mask.dtype == np.float16 and mask.min() == np.float16(-32768)


def test_bad_chunks_are_refused():
    with pytest.raises(ConfigError):
        chunk_mask(np.ones(8, bool), 0, 8, 4)
    with pytest.raises(InputError):
        chunk_mask(np.ones(3, bool), 0, 4, 8)
