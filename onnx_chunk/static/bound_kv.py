"""A KV cache bound at a fixed capacity C and written in place: GroupQueryAttention's layout.

A graph from `fix-shapes` keeps GroupQueryAttention's contract: `past_key_values.N.key|value`
[1, kv_heads, C, head_size] bound at full capacity, `present.N.*` the same buffer with the
forward's rows written at positions [length, length + rows), and an integer `attention_mask`
[1, C] holding ones on every position written so far (GQA derives seqlens_k, the write offset
and the causal limit from its sum). Positions sit at their own index, so this cache cannot
slide: a request that would pass C is refused before it runs. Rows written after the last real
row (right padding of the last chunk) are not counted; the next forward overwrites them.

On the device each buffer is bound as both the past input and the present output, so the
attention writes the new rows in place and nothing is copied between forwards.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from onnx_chunk.errors import CapacityError, InputError
from onnx_chunk.runtime.device.provider import Device
from onnx_chunk.static.kv_buffers import StaticKVBuffers, bind_in_place


class BoundKVCache(StaticKVBuffers):
    """Per-layer K and V buffers [1, kv_heads, C, head_size] holding positions 0..length-1.

    Rules:
    1. A fresh cache is all zeros with length 0.
    2. `mask(rows)` is the forward's attention_mask [1, C]: ones on [0, length + rows), zeros
       after; CapacityError when the rows do not fit.
    3. `write(keys, values, real_rows)` takes the forward's present buffers as the cache and
       advances the length by the real rows only.
    """

    def __init__(
        self, num_layers: int, kv_heads: int, capacity: int, head_size: int,
        dtype: np.dtype | type = np.float32, device: Device | None = None,
    ) -> None:
        super().__init__(num_layers, kv_heads, capacity, head_size, dtype, device)
        self.length = 0

    @property
    def dropped_positions(self) -> int:
        """Real positions lost: none, since this cache never slides."""
        return 0

    def mask(self, rows: int, dtype: np.dtype | type = np.int64) -> np.ndarray:
        """The attention_mask [1, C] of a forward of `rows` rows at the current length."""
        end = self.length + rows
        if rows < 1 or end > self.capacity:
            raise CapacityError(
                f"a forward of {rows} rows after {self.length} positions needs {end} of the "
                f"KV capacity C={self.capacity}; a cache bound at capacity cannot slide: raise C "
                f"or shorten the request"
            )
        mask = np.zeros((1, self.capacity), dtype=dtype)
        mask[0, :end] = 1
        return mask

    def write(self, keys: list[np.ndarray], values: list[np.ndarray], real_rows: int) -> None:
        """Take one forward's present K/V (the whole buffers) and count its real rows."""
        if len(keys) != self.num_layers or len(values) != self.num_layers:
            raise InputError(
                f"expected present K/V for {self.num_layers} layers, got {len(keys)} keys and "
                f"{len(values)} values"
            )
        expected = self.shape
        for layer, (key, value) in enumerate(zip(keys, values)):
            if key.shape != expected or value.shape != expected:
                raise InputError(
                    f"layer {layer}: expected present K/V of shape {expected} (the whole "
                    f"buffer), got {key.shape} and {value.shape}"
                )
        self._check_rows(real_rows)
        for buffers, arrays in ((self.key_buffers, keys), (self.value_buffers, values)):
            for buffer, array in zip(buffers, arrays):
                buffer.write(array)
        self.length += real_rows

    def _check_rows(self, real_rows: int) -> None:
        if not 0 <= real_rows <= self.capacity - self.length:
            raise InputError(f"cannot count {real_rows} new positions after {self.length} in a "
                             f"cache of capacity {self.capacity}")

    def forward_mask(self, valid: np.ndarray, start: int, rows: int,
                     dtype: np.dtype | type) -> np.ndarray:
        """`mask(rows)`: the length is the cache's own, padding only ever trails it."""
        return self.mask(rows, dtype)

    def bind(self, binding: ort.IOBinding, rows: int) -> None:
        """Each buffer as its layer's past input and present output: written in place."""
        for layer in range(self.num_layers):
            bind_in_place(binding, layer, "key", self.key_buffers[layer],
                          self.key_buffers[layer])
            bind_in_place(binding, layer, "value", self.value_buffers[layer],
                          self.value_buffers[layer])

    def after_forward(self, new_valid: np.ndarray) -> None:
        """Count the forward's real rows (the attention wrote them in place)."""
        real_rows = int(np.count_nonzero(new_valid))
        self._check_rows(real_rows)
        self.length += real_rows

    def _recent_slots(self, count: int) -> slice:
        return slice(self.length - count, self.length)
