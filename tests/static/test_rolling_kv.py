"""The rolling KV cache: concatenate on the right, drop as many on the left, count the loss."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_chunk.errors import ConfigError, InputError
from onnx_chunk.static.rolling_kv import RollingKVCache


def _chunk(first: int, rows: int, layers: int = 2) -> list[np.ndarray]:
    # position p's K holds p + 1 everywhere, so a slot tells which position it holds
    values = np.arange(first + 1, first + rows + 1, dtype=np.float32)
    return [np.broadcast_to(values[None, None, :, None] * (layer + 1), (1, 2, rows, 3)).copy()
            for layer in range(layers)]


def test_rolling_keeps_the_last_capacity_positions_right_aligned():
    cache = RollingKVCache(num_layers=2, kv_heads=2, capacity=6, head_size=3)
    valid = np.array([False, True, True, True, True, True, True, True])
    dropped = []
    for start in (0, 4):
        dropped.append(cache.roll(_chunk(start, 4), _chunk(start, 4), valid[start:start + 4]))
        stop = start + 4
        expected = np.zeros(6, dtype=np.float32)
        seen = np.arange(max(0, stop - 6), stop) + 1
        expected[6 - len(seen):] = seen
        for layer in range(2):
            np.testing.assert_array_equal(cache.keys[layer][0, 1, :, 2], expected * (layer + 1))
            np.testing.assert_array_equal(cache.values[layer][0, 0, :, 0], expected * (layer + 1))
    assert dropped == [0, 1]
    assert cache.valid.tolist() == [True] * 6
    stats = cache.stats
    assert (stats.positions_seen, stats.real_positions_dropped, stats.pad_positions_dropped) == \
        (8, 1, 1)


def test_nothing_is_lost_while_the_cache_holds_everything():
    cache = RollingKVCache(1, 2, 8, 3)
    for start in range(0, 8, 2):
        assert cache.roll(_chunk(start, 2, 1), _chunk(start, 2, 1), np.ones(2, bool)) == 0
    assert cache.stats.real_positions_dropped == 0 and cache.stats.pad_positions_dropped == 0
    assert cache.roll(_chunk(8, 1, 1), _chunk(8, 1, 1), np.ones(1, bool)) == 1


def test_wrong_shapes_and_sizes_are_refused():
    with pytest.raises(ConfigError):
        RollingKVCache(0, 2, 8, 3)
    cache = RollingKVCache(2, 2, 4, 3)
    with pytest.raises(InputError, match="2 layers"):
        cache.roll(_chunk(0, 2, 1), _chunk(0, 2, 1), np.ones(2, bool))
    with pytest.raises(InputError, match="shape"):
        cache.roll(_chunk(0, 2), _chunk(0, 3), np.ones(2, bool))
    with pytest.raises(InputError, match="1..4"):
        cache.roll(_chunk(0, 5), _chunk(0, 5), np.ones(5, bool))
