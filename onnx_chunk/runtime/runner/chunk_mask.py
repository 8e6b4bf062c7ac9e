"""The attention mask of native chunks: per row a count of ones, bound at least S wide.

A right-padded chunk (`native_chunks`) needs what neither repeat-path mask holds: row b with
T_b = P_b + Q_b ones and zeros after, in a mask at least as wide as the padded query width S
(GroupQueryAttention refuses a narrower `total_sequence_length` for a cache that is not
windowed). `ChunkMask.set_counts` writes that; the repeat path's calls (`set`, `set_rows`)
are the special cases S = Q. The policy is the runtime's, as for `attention_mask`:

1. logical: a forward binds `[rows, width]` at the buffer's start. One row: the buffer's row
   0 is kept up to date column by column (only the columns whose value changes are written);
   several rows: the whole `[rows, width]` mask is written at the start.
2. capacity: the whole `[rows, capacity]` buffer is bound once; each row's changed columns
   are written in place (a fixed shape, what CUDA graphs replay).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from onnx_chunk.runtime.device.provider import Device, MaskPolicy
from onnx_chunk.runtime.runner.attention_mask import AttentionMask
from onnx_chunk.runtime.state.ports import MASK_INPUT


class ChunkMask(AttentionMask):
    """A `[rows, capacity]` mask of per-row counts (see the module docstring)."""

    capacity_wide = False

    def __init__(self, rows: int, capacity: int, dtype: np.dtype, device: Device) -> None:
        super().__init__(rows, capacity, dtype, device)
        self._host = np.zeros((rows, capacity), dtype=dtype)
        # The ones each row holds in the buffer's [rows, capacity] layout; None: the buffer's
        # start holds a compact [rows, width] mask instead (logical, several rows).
        self._ones: np.ndarray | None = np.zeros(rows, dtype=np.int64)

    def reset(self) -> None:
        self._host[...] = 0
        self._ones = np.zeros(self.rows, dtype=np.int64)
        self.buffer.write(self._host)

    def bind(self, io: ort.IOBinding) -> None:
        if self.capacity_wide:
            io.bind_ortvalue_input(MASK_INPUT, self.buffer.value)

    def set(self, io: ort.IOBinding, end: int) -> None:
        self.set_counts(io, np.array([end]), end)

    def width(self, lengths: list[int]) -> int:
        return self.capacity if self.capacity_wide else max(lengths) + 1

    def set_rows(self, io: ort.IOBinding, lengths: list[int]) -> None:
        self.set_counts(io, np.asarray(lengths) + 1, max(lengths) + 1)

    def set_counts(self, io: ort.IOBinding, ones: np.ndarray, width: int) -> None:
        """Row b holds `ones[b]` ones, zeros after; bound `width` columns wide (logical)."""
        ones = np.asarray(ones, dtype=np.int64)
        if len(ones) != self.rows or width > self.capacity or int(ones.max()) > width:
            raise ValueError(f"a mask of {self.rows} rows and {self.capacity} columns cannot "
                             f"hold {ones.tolist()} ones at width {width}")
        if not self.capacity_wide and self.rows > 1:
            mask = (np.arange(width)[None, :] < ones[:, None]).astype(self.buffer.dtype)
            self.buffer.write_range(mask.reshape(-1), 0, mask.size)
            self._ones = None
            self._bind_rows(io, mask.shape)
            return
        if self._ones is None:
            self.reset()
        held = self._ones
        assert held is not None
        for row, (old, new) in enumerate(zip(held.tolist(), ones.tolist())):
            if old == new:
                continue
            low, high = min(old, new), max(old, new)
            self._host[row, low:high] = 1 if new > old else 0
            start = row * self.capacity
            self.buffer.write_range(self._host, start + low, start + high)
            held[row] = new
        if not self.capacity_wide:
            self._bind_rows(io, (1, width))


class CapacityChunkMask(ChunkMask):
    """`ChunkMask` under the capacity policy: the whole buffer bound once."""

    capacity_wide = True


def chunk_mask_kind(policy: MaskPolicy) -> type[ChunkMask]:
    """The native-chunk mask class of `policy`, chosen once per runtime."""
    return CapacityChunkMask if MaskPolicy(policy) is MaskPolicy.CAPACITY else ChunkMask
