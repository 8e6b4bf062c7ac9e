"""What the static runner's two KV caches share: fixed buffers of C positions per layer, on the
runner's device.

Every buffer is allocated once on the device (`device_zeros`) and bound to the forwards through
IOBinding, so the cache never crosses to the host while a request runs: a forward reads and
writes device memory, and what the caches do between forwards (rolling the right-aligned
cache, `RollingKVCache`) are copies from device memory to device memory. Only `keys`, `values`
and `recent` read the cache back, for callers that inspect it (tests, `validate`).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from onnx_chunk.errors import ConfigError
from onnx_chunk.runtime.device.buffers import DeviceBuffer, device_zeros
from onnx_chunk.runtime.device.provider import Device, device_for

PAST = "past_key_values.{}.{}"
PRESENT = "present.{}.{}"


class StaticKVBuffers:
    """Per-layer K and V buffers [1, kv_heads, C, head_size] on `device` (default the CPU),
    zeros when fresh.

    The subclasses say where positions sit (`RollingKVCache`: right-aligned and rolled,
    `BoundKVCache`: at their own index), and so which mask a forward takes, what a forward
    binds as its past and present, what happens to the cache after it, and which slots
    `recent` reads.
    """

    def __init__(
        self, num_layers: int, kv_heads: int, capacity: int, head_size: int,
        dtype: np.dtype | type = np.float32, device: Device | None = None,
    ) -> None:
        if min(num_layers, kv_heads, capacity, head_size) < 1:
            raise ConfigError(
                f"a KV cache needs positive sizes, got layers={num_layers}, kv_heads={kv_heads}, "
                f"capacity={capacity}, head_size={head_size}"
            )
        self.device = device if device is not None else device_for("cpu")
        self.shape = (1, kv_heads, capacity, head_size)
        self.dtype = np.dtype(dtype)
        self.capacity = capacity
        self.num_layers = num_layers
        self.key_buffers = [self._zeros(self.shape) for _ in range(num_layers)]
        self.value_buffers = [self._zeros(self.shape) for _ in range(num_layers)]

    def _zeros(self, shape: tuple[int, ...]) -> DeviceBuffer:
        return device_zeros(shape, self.dtype, self.device)

    @property
    def keys(self) -> list[np.ndarray]:
        """Every layer's K on the host (a view where the device has one, else a copy)."""
        return [host_array(buffer) for buffer in self.key_buffers]

    @property
    def values(self) -> list[np.ndarray]:
        """Every layer's V on the host (a view where the device has one, else a copy)."""
        return [host_array(buffer) for buffer in self.value_buffers]

    def forward_mask(self, valid: np.ndarray, start: int, rows: int,
                     dtype: np.dtype | type) -> np.ndarray:
        """The attention_mask of a forward of `rows` rows at sequence index `start`; `valid`
        marks the real positions of the whole sequence so far (padding False)."""
        raise NotImplementedError

    def bind(self, binding: ort.IOBinding, rows: int) -> None:
        """Bind every layer's past input and present output for a forward of `rows` rows."""
        raise NotImplementedError

    def after_forward(self, new_valid: np.ndarray) -> None:
        """Take in the forward just run (bound with `bind`), whose rows are real where
        `new_valid` is True; works on the device only."""
        raise NotImplementedError

    @property
    def dropped_positions(self) -> int:
        """Real positions lost to the cache so far."""
        raise NotImplementedError

    def recent(self, count: int) -> list[np.ndarray]:
        """Every layer's K, then every layer's V, over the `count` latest real positions (host
        copies)."""
        window = self._recent_slots(count)
        return [np.array(array[:, :, window]) for array in (*self.keys, *self.values)]

    def _recent_slots(self, count: int) -> slice:
        raise NotImplementedError


def bind_in_place(binding: ort.IOBinding, layer: int, kind: str, past: DeviceBuffer,
                  present: DeviceBuffer) -> None:
    """Bind `past` as layer `layer`'s past `kind` ("key" or "value") input and `present` as
    its present output."""
    binding.bind_ortvalue_input(PAST.format(layer, kind), past.value)
    binding.bind_ortvalue_output(PRESENT.format(layer, kind), present.value)


def host_array(buffer: DeviceBuffer) -> np.ndarray:
    """`buffer` on the host: its host view, else a copy of the whole buffer."""
    if buffer.host is not None:
        return buffer.host
    size = int(np.prod(buffer.shape, dtype=np.int64))
    return np.array(buffer.read(0, size)).reshape(buffer.shape)
