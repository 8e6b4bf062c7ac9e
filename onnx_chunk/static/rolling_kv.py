"""A KV cache of fixed capacity C whose valid content is right-aligned: a conveyor belt.

A static decoder takes past K/V of exactly C positions per
layer. Each forward's new K/V (c positions) goes in on the right and the same number of oldest
positions drops off the left: concatenate, then keep the last C. While at most C positions have
been seen nothing real is lost and the result equals ordinary prefill; beyond that the cache is a
sliding window and the oldest context is forgotten. Every real position dropped is counted (the
runner reports the count in its result and warns), never silent; dropped padding costs nothing
and is counted apart.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from onnx_chunk.errors import InputError
from onnx_chunk.static.kv_buffers import StaticKVBuffers
from onnx_chunk.static.mask import chunk_mask

logger = logging.getLogger(__name__)


@dataclass
class RollingKVStats:
    """What the cache has seen and forgotten."""

    positions_seen: int = 0
    real_positions_dropped: int = 0
    """Real (non-padding) positions that fell off the left: lost context."""
    pad_positions_dropped: int = 0


class RollingKVCache(StaticKVBuffers):
    """Per-layer K and V buffers [1, kv_heads, C, head_size], content right-aligned.

    Rules:
    1. A fresh cache is all zeros and all slots are invalid (masked).
    2. `roll(new_keys, new_values, new_valid)` appends r positions on the right of every layer
       and drops the r leftmost slots: concat(old, new)[..., r:, :].
    3. `valid` follows the same roll, so slot j of the cache holds the position
       positions_seen - C + j, and only valid slots are real tokens.
    """

    def __init__(
        self, num_layers: int, kv_heads: int, capacity: int, head_size: int,
        dtype: np.dtype | type = np.float32,
    ) -> None:
        super().__init__(num_layers, kv_heads, capacity, head_size, dtype)
        self.valid = np.zeros(capacity, dtype=bool)
        self.stats = RollingKVStats()

    @property
    def dropped_positions(self) -> int:
        """Real positions that fell off the left so far."""
        return self.stats.real_positions_dropped

    def forward_mask(self, valid: np.ndarray, start: int, rows: int,
                     dtype: np.dtype | type) -> np.ndarray:
        """The additive mask [1, 1, rows, C] (`mask.chunk_mask`)."""
        return chunk_mask(valid, start, rows, self.capacity, dtype)

    def absorb(self, keys: list[np.ndarray], values: list[np.ndarray],
               new_valid: np.ndarray) -> None:
        """Roll the forward's new K/V in."""
        self.roll(keys, values, new_valid)

    def _recent_slots(self, count: int) -> slice:
        return slice(self.capacity - count, self.capacity)

    def roll(
        self, new_keys: list[np.ndarray], new_values: list[np.ndarray], new_valid: np.ndarray
    ) -> int:
        """Roll in one forward's K/V ([1, kv_heads, r, head_size] per layer); returns the real
        positions dropped by this roll."""
        rows = len(new_valid)
        if len(new_keys) != len(self.keys) or len(new_values) != len(self.values):
            raise InputError(
                f"expected new K/V for {len(self.keys)} layers, got {len(new_keys)} keys and "
                f"{len(new_values)} values"
            )
        if not 1 <= rows <= self.capacity:
            raise InputError(f"a roll takes 1..{self.capacity} positions, got {rows}")
        for layer, (key, value) in enumerate(zip(new_keys, new_values)):
            expected = self.keys[layer].shape[:2] + (rows,) + self.keys[layer].shape[3:]
            if key.shape != expected or value.shape != expected:
                raise InputError(
                    f"layer {layer}: expected new K/V of shape {expected}, got {key.shape} and "
                    f"{value.shape}"
                )
            self.keys[layer] = np.concatenate([self.keys[layer], key], axis=2)[:, :, rows:]
            self.values[layer] = np.concatenate([self.values[layer], value], axis=2)[:, :, rows:]
        leaving = self.valid[:rows]
        real_dropped = int(leaving.sum())
        empty_slots = self.capacity - min(self.stats.positions_seen, self.capacity)
        filled_leaving = max(0, rows - empty_slots)
        self.stats.pad_positions_dropped += filled_leaving - real_dropped
        self.stats.real_positions_dropped += real_dropped
        self.stats.positions_seen += rows
        self.valid = np.concatenate([self.valid, np.asarray(new_valid, dtype=bool)])[rows:]
        if real_dropped:
            logger.debug(
                "KV cache of capacity %d is full: %d real positions dropped off the left "
                "(%d in all); attention is now a sliding window",
                self.capacity, real_dropped, self.stats.real_positions_dropped,
            )
        return real_dropped
