"""Additive attention masks for static-graph chunks: c query rows against a right-aligned cache.

A static decoder attends each chunk's c query rows to a fixed key axis of
C slots: the KV cache after this chunk's own K/V were rolled in on the right. The chunk's mask is
therefore the chunk's c rows of the whole sequence's causal-plus-padding mask, with the key axis
cut to the last C positions seen and right-aligned to C; every other cell holds a large finite
negative number.

Why a finite fill value and not -inf: a left-padding row attends to nothing real, so its whole
row is masked. With -inf, softmax computes exp(-inf - (-inf)) = exp(nan) and the row (and
everything it later touches) becomes NaN. With a finite value the row is a harmless uniform
average whose output is ignored, and in any row that has a real key the masked cells still get an
exact zero weight, because exp(fill - max) underflows to 0.

The value chosen is -2 ** (maxexp - 1) of the dtype: half the largest power of two it can hold.
For float16 that is -32768 (the familiar "-32768 style" constant), for float32 -2 ** 127
(about -1.7e38, half of np.finfo(np.float32).min). The half leaves headroom: a model computes
scores + mask, and np.finfo(dtype).min itself would overflow to -inf as soon as a negative score
is added to it (in float16, -65504 - 100 is already -inf).
"""

from __future__ import annotations

import numpy as np

from onnx_chunk.errors import ConfigError, InputError


def mask_fill_value(dtype: np.dtype | type) -> float:
    """The finite value masked cells hold: -2 ** (maxexp - 1) of the floating `dtype`."""
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise ConfigError(f"an additive attention mask needs a floating dtype, got {dtype}")
    return -float(2.0 ** (np.finfo(dtype).maxexp - 1))


def chunk_mask(
    valid: np.ndarray,
    start: int,
    rows: int,
    capacity: int,
    dtype: np.dtype | type = np.float32,
) -> np.ndarray:
    """The additive mask [1, 1, rows, capacity] for query positions [start, start + rows).

    `valid` says, for every position of the sequence up to at least start + rows, whether it holds
    a real token (False for left padding). Rules:
    1. Query row i is position start + i; key positions are the last `capacity` positions seen
       after this chunk, [max(0, end - capacity), end) with end = start + rows, right-aligned so
       the newest position sits in the last column.
    2. A cell is open (0) when its key is a real token at or before the query's position
       (causal plus padding); every other cell, including the columns left of the first position
       when fewer than `capacity` were seen, holds `mask_fill_value(dtype)`.
    """
    end = start + rows
    if start < 0 or rows < 1:
        raise ConfigError(f"a mask needs start >= 0 and rows >= 1, got start={start}, rows={rows}")
    if rows > capacity:
        raise ConfigError(f"a chunk of {rows} rows does not fit a cache of capacity {capacity}")
    if len(valid) < end:
        raise InputError(
            f"validity is known for {len(valid)} positions but the chunk ends at position {end}"
        )
    first = max(0, end - capacity)
    key_positions = np.arange(first, end)
    query_positions = np.arange(start, end)
    open_cells = (key_positions[None, :] <= query_positions[:, None]) & np.asarray(
        valid[first:end], dtype=bool
    )[None, :]
    mask = np.full((rows, capacity), mask_fill_value(dtype), dtype=dtype)
    mask[:, capacity - (end - first):][open_cells] = 0
    return mask[None, None]
