"""What the static runner's two KV caches share: fixed buffers of C positions per layer."""

from __future__ import annotations

import numpy as np

from onnx_chunk.errors import ConfigError


class StaticKVBuffers:
    """Per-layer K and V buffers [1, kv_heads, C, head_size], zeros when fresh.

    The subclasses say where positions sit (`RollingKVCache`: right-aligned and rolled,
    `BoundKVCache`: at their own index), and so which mask a forward takes, how its present
    K/V come in and which slots `recent` reads.
    """

    def __init__(
        self, num_layers: int, kv_heads: int, capacity: int, head_size: int,
        dtype: np.dtype | type = np.float32,
    ) -> None:
        if min(num_layers, kv_heads, capacity, head_size) < 1:
            raise ConfigError(
                f"a KV cache needs positive sizes, got layers={num_layers}, kv_heads={kv_heads}, "
                f"capacity={capacity}, head_size={head_size}"
            )
        shape = (1, kv_heads, capacity, head_size)
        self.capacity = capacity
        self.keys = [np.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [np.zeros(shape, dtype=dtype) for _ in range(num_layers)]

    def forward_mask(self, valid: np.ndarray, start: int, rows: int,
                     dtype: np.dtype | type) -> np.ndarray:
        """The attention_mask of a forward of `rows` rows at sequence index `start`; `valid`
        marks the real positions of the whole sequence so far (padding False)."""
        raise NotImplementedError

    def absorb(self, keys: list[np.ndarray], values: list[np.ndarray],
               new_valid: np.ndarray) -> None:
        """Take one forward's present K/V, whose rows are real where `new_valid` is True."""
        raise NotImplementedError

    @property
    def dropped_positions(self) -> int:
        """Real positions lost to the cache so far."""
        raise NotImplementedError

    def recent(self, count: int) -> list[np.ndarray]:
        """Every layer's K, then every layer's V, over the `count` latest real positions."""
        window = self._recent_slots(count)
        return [array[:, :, window] for array in (*self.keys, *self.values)]

    def _recent_slots(self, count: int) -> slice:
        raise NotImplementedError
