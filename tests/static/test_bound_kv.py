"""The KV cache bound at capacity: GQA's in-place layout, its mask and its refusal to slide."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_chunk.errors import CapacityError, InputError
from onnx_chunk.static.bound_kv import BoundKVCache


def test_the_mask_covers_the_written_positions_and_the_forwards_rows():
    cache = BoundKVCache(num_layers=2, kv_heads=1, capacity=6, head_size=2)
    assert cache.mask(4).tolist() == [[1, 1, 1, 1, 0, 0]]
    present = [np.full((1, 1, 6, 2), layer, np.float32) for layer in range(2)]
    cache.write(present, present, real_rows=3)  # a padded chunk: 4 rows, 3 real
    assert cache.length == 3 and cache.mask(1).tolist() == [[1, 1, 1, 1, 0, 0]]
    assert [array.shape for array in cache.recent(2)] == [(1, 1, 2, 2)] * 4
    assert cache.recent(2)[1][0, 0, 0, 0] == 1 and cache.dropped_positions == 0


def test_it_refuses_to_slide_and_to_take_partial_buffers():
    cache = BoundKVCache(num_layers=1, kv_heads=1, capacity=4, head_size=2)
    full = [np.zeros((1, 1, 4, 2), np.float32)]
    cache.write(full, full, real_rows=4)
    with pytest.raises(CapacityError, match="cannot slide"):
        cache.mask(1)
    with pytest.raises(InputError, match="whole buffer"):
        BoundKVCache(1, 1, 4, 2).write([np.zeros((1, 1, 1, 2))] * 1, full, real_rows=1)
