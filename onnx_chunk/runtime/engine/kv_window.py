"""Which positions a window-sized KV cache still holds (GroupQueryAttention's
`sliding_window_cache=1`).

Such a cache has `capacity` rows for a `window` of attention (capacity >= window). ONNX
Runtime's kernel keeps the most recent positions contiguously from row 0 and, once the total
`T` passes the capacity, evicts `capacity - window + 1` positions at a time; how many it holds
depends on `T` alone, never on how the tokens were split into forwards. Dropping the last
`count` positions (rewinding) is exact only when none of the positions it would need again was
evicted: `resident(T - count) == resident(T) - count`.
"""

from __future__ import annotations

from onnx_chunk.errors import ConfigError


def resident_rows(total: int, capacity: int, window: int) -> int:
    """How many of `total` positions a cache of `capacity` rows for `window` still holds."""
    if window < 1 or capacity < window:
        raise ConfigError(f"a window-sized cache needs 1 <= window <= capacity, got window "
                          f"{window} and capacity {capacity}")
    if total <= capacity:
        return total
    reclaimed = capacity - window + 1
    evictions = -(-(total - capacity) // reclaimed)
    return total - reclaimed * evictions


def rewind_is_exact(total: int, count: int, capacity: int, window: int) -> bool:
    """Whether dropping the last `count` of `total` positions loses nothing still needed."""
    return (resident_rows(total - count, capacity, window)
            == resident_rows(total, capacity, window) - count)
