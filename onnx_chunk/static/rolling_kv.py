"""A KV cache of fixed capacity C whose valid content is right-aligned: a conveyor belt.

A static decoder takes past K/V of exactly C positions per
layer. Each forward's new K/V (c positions) goes in on the right and the same number of oldest
positions drops off the left: concatenate, then keep the last C. While at most C positions have
been seen nothing real is lost and the result equals ordinary prefill; beyond that the cache is a
sliding window and the oldest context is forgotten. Every real position dropped is counted (the
runner reports the count in its result and warns), never silent; dropped padding costs nothing
and is counted apart.

On the device: a forward reads the cache and writes its new K/V into a small present buffer of
its rows; the roll then writes the cache's kept positions and the new ones into a second buffer
of the same size, by device-to-device copies (one pair per KV head), and the two buffers swap
roles. Nothing crosses to the host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from onnx_chunk.errors import InputError
from onnx_chunk.runtime.device.buffers import DeviceBuffer, copy_on_device
from onnx_chunk.runtime.device.provider import Device
from onnx_chunk.static.kv_buffers import StaticKVBuffers, bind_in_place
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
        dtype: np.dtype | type = np.float32, device: Device | None = None,
    ) -> None:
        super().__init__(num_layers, kv_heads, capacity, head_size, dtype, device)
        self.valid = np.zeros(capacity, dtype=bool)
        self.stats = RollingKVStats()
        # What each roll writes into, then swaps with the cache.
        self._spare = ([self._zeros(self.shape) for _ in range(num_layers)],
                       [self._zeros(self.shape) for _ in range(num_layers)])
        # The present K and V buffers of a forward of that many rows, allocated once.
        self._present: dict[int, tuple[list[DeviceBuffer], list[DeviceBuffer]]] = {}

    @property
    def dropped_positions(self) -> int:
        """Real positions that fell off the left so far."""
        return self.stats.real_positions_dropped

    def forward_mask(self, valid: np.ndarray, start: int, rows: int,
                     dtype: np.dtype | type) -> np.ndarray:
        """The additive mask [1, 1, rows, C] (`mask.chunk_mask`)."""
        return chunk_mask(valid, start, rows, self.capacity, dtype)

    def bind(self, binding: ort.IOBinding, rows: int) -> None:
        """The cache as past; the present K/V of `rows` rows into buffers of their own."""
        keys, values = self._present_buffers(rows)
        for layer in range(self.num_layers):
            bind_in_place(binding, layer, "key", self.key_buffers[layer], keys[layer])
            bind_in_place(binding, layer, "value", self.value_buffers[layer], values[layer])

    def after_forward(self, new_valid: np.ndarray) -> None:
        """Roll the forward's new K/V in."""
        self._roll_in(np.asarray(new_valid, dtype=bool))

    def _present_buffers(self, rows: int) -> tuple[list[DeviceBuffer], list[DeviceBuffer]]:
        if rows not in self._present:
            shape = (*self.shape[:2], rows, self.shape[3])
            self._present[rows] = ([self._zeros(shape) for _ in range(self.num_layers)],
                                   [self._zeros(shape) for _ in range(self.num_layers)])
        return self._present[rows]

    def _recent_slots(self, count: int) -> slice:
        return slice(self.capacity - count, self.capacity)

    def roll(
        self, new_keys: list[np.ndarray], new_values: list[np.ndarray], new_valid: np.ndarray
    ) -> int:
        """Roll in one forward's K/V ([1, kv_heads, r, head_size] per layer); returns the real
        positions dropped by this roll."""
        rows = len(new_valid)
        if len(new_keys) != self.num_layers or len(new_values) != self.num_layers:
            raise InputError(
                f"expected new K/V for {self.num_layers} layers, got {len(new_keys)} keys and "
                f"{len(new_values)} values"
            )
        if not 1 <= rows <= self.capacity:
            raise InputError(f"a roll takes 1..{self.capacity} positions, got {rows}")
        expected = (*self.shape[:2], rows, self.shape[3])
        for layer, (key, value) in enumerate(zip(new_keys, new_values)):
            if key.shape != expected or value.shape != expected:
                raise InputError(
                    f"layer {layer}: expected new K/V of shape {expected}, got {key.shape} and "
                    f"{value.shape}"
                )
        present_keys, present_values = self._present_buffers(rows)
        for layer, (key, value) in enumerate(zip(new_keys, new_values)):
            present_keys[layer].write(key)
            present_values[layer].write(value)
        return self._roll_in(np.asarray(new_valid, dtype=bool))

    def _roll_in(self, new_valid: np.ndarray) -> int:
        """Roll the present buffers of a forward of len(new_valid) rows into the cache, on the
        device; returns the real positions dropped."""
        rows = len(new_valid)
        present = self._present_buffers(rows)
        for buffers, spares, new in zip((self.key_buffers, self.value_buffers), self._spare,
                                        present):
            for layer in range(self.num_layers):
                self._roll_layer(buffers[layer], spares[layer], new[layer], rows)
                buffers[layer], spares[layer] = spares[layer], buffers[layer]
        leaving = self.valid[:rows]
        real_dropped = int(leaving.sum())
        empty_slots = self.capacity - min(self.stats.positions_seen, self.capacity)
        filled_leaving = max(0, rows - empty_slots)
        self.stats.pad_positions_dropped += filled_leaving - real_dropped
        self.stats.real_positions_dropped += real_dropped
        self.stats.positions_seen += rows
        self.valid = np.concatenate([self.valid, new_valid])[rows:]
        if real_dropped:
            logger.debug(
                "KV cache of capacity %d is full: %d real positions dropped off the left "
                "(%d in all); attention is now a sliding window",
                self.capacity, real_dropped, self.stats.real_positions_dropped,
            )
        return real_dropped

    def _roll_layer(self, cache: DeviceBuffer, target: DeviceBuffer, new: DeviceBuffer,
                    rows: int) -> None:
        """`target` = the last C - rows positions of `cache`, then the `rows` of `new`, head by
        head ([1, kv_heads, positions, head_size] are contiguous per head)."""
        _, heads, capacity, head_size = self.shape
        kept = (capacity - rows) * head_size
        for head in range(heads):
            start = head * capacity * head_size
            copy_on_device(target, start, cache, start + rows * head_size, kept)
            copy_on_device(target, start + kept, new, head * rows * head_size, rows * head_size)
