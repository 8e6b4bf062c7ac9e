"""The attention mask of a forward: one device buffer, filled and bound by the mask policy.

GroupQueryAttention learns each row's length from the mask (`seqlens_k = sum(mask) - 1`,
`total_sequence_length = mask width`), so the mask is the only input that changes when a
length does. A buffer of `[rows, capacity]` is allocated once (rows: 1 for a sequence slot,
the engine's slots for the batched decode) and never moves. The policy is chosen once per
runtime (`mask_kind`, from `Device.mask_policy`; provider.py has the measurements):

1. `LogicalMask`: the buffer holds ones; a forward of one row ending at column `end` binds
   its first `end` columns (same address, new shape): nothing is written per step. A batched
   decode writes its `[rows, width]` mask, `width` the longest row's need, into the start of
   the buffer and binds that.
2. `CapacityMask`: the whole capacity-wide buffer is bound once, when a binding is made (a
   fixed shape: what CUDA graphs replay); ones for the valid prefix, zeros after. A forward of
   one row writes only the columns that change (one element per decode step); a batched
   decode rewrites every row.
"""

from __future__ import annotations

import abc

import numpy as np
import onnxruntime as ort

from onnx_chunk.runtime.device.buffers import device_zeros
from onnx_chunk.runtime.device.provider import Device, MaskPolicy
from onnx_chunk.runtime.runner.ports import MASK_INPUT


class AttentionMask(abc.ABC):
    """A `[rows, capacity]` mask buffer on `device` and the way its policy binds it."""

    def __init__(self, rows: int, capacity: int, dtype: np.dtype, device: Device) -> None:
        self.rows = rows
        self.capacity = capacity
        self.device = device
        self.buffer = device_zeros((rows, capacity), dtype, device)

    @abc.abstractmethod
    def reset(self) -> None:
        """The mask of an empty sequence (a slot handed out again)."""

    @abc.abstractmethod
    def bind(self, io: ort.IOBinding) -> None:
        """Bind what stays bound for good, when `io` is made."""

    @abc.abstractmethod
    def set(self, io: ort.IOBinding, end: int) -> None:
        """Before a forward of one row: columns [0, end) valid, the rest not."""

    @abc.abstractmethod
    def width(self, lengths: list[int]) -> int:
        """How wide a batched decode step at `lengths` binds the mask."""

    @abc.abstractmethod
    def set_rows(self, io: ort.IOBinding, lengths: list[int]) -> None:
        """Before a batched decode step: row i holds lengths[i] + 1 ones, zeros after."""

    def _write_rows(self, lengths: list[int], width: int) -> tuple[int, ...]:
        """Write the decode mask of `lengths`, `width` columns, into the buffer's start."""
        mask = decode_mask(lengths, width, self.buffer.dtype)
        self.buffer.write_range(mask.reshape(-1), 0, mask.size)
        return mask.shape

    def _bind_rows(self, io: ort.IOBinding, shape: tuple[int, ...]) -> None:
        """Bind the leading elements of the buffer as a mask of `shape` (same address)."""
        device = self.device
        io.bind_input(MASK_INPUT, device.device_type, device.device_id, self.buffer.dtype,
                      list(shape), self.buffer.value.data_ptr())


class LogicalMask(AttentionMask):
    """The logical policy: a prefix of an all-ones buffer, bound at each forward's width."""

    def __init__(self, rows: int, capacity: int, dtype: np.dtype, device: Device) -> None:
        super().__init__(rows, capacity, dtype, device)
        self.buffer.write(np.ones((rows, capacity), dtype=dtype))

    def reset(self) -> None:
        """Nothing to do: a one-row forward binds a prefix of ones, whatever came before."""

    def bind(self, io: ort.IOBinding) -> None:
        """Nothing stays bound: each forward binds its own width."""

    def set(self, io: ort.IOBinding, end: int) -> None:
        self._bind_rows(io, (1, end))

    def width(self, lengths: list[int]) -> int:
        return max(lengths) + 1

    def set_rows(self, io: ort.IOBinding, lengths: list[int]) -> None:
        self._bind_rows(io, self._write_rows(lengths, self.width(lengths)))


class CapacityMask(AttentionMask):
    """The capacity policy: the whole buffer bound once, rewritten in place."""

    def __init__(self, rows: int, capacity: int, dtype: np.dtype, device: Device) -> None:
        super().__init__(rows, capacity, dtype, device)
        # A host copy of row 0 and how many leading ones it (and the device buffer) holds.
        self._host = np.zeros((1, capacity), dtype=dtype)
        self._ones = 0

    def reset(self) -> None:
        self._host[...] = 0
        self._ones = 0
        self.buffer.write(np.zeros(self.buffer.shape, dtype=self.buffer.dtype))

    def bind(self, io: ort.IOBinding) -> None:
        io.bind_ortvalue_input(MASK_INPUT, self.buffer.value)

    def set(self, io: ort.IOBinding, end: int) -> None:
        ones = self._ones
        if end > ones:
            self._host[0, ones:end] = 1
        elif end < ones:
            self._host[0, end:ones] = 0
        self.buffer.write_range(self._host, min(end, ones), max(end, ones))
        self._ones = end

    def width(self, lengths: list[int]) -> int:
        return self.capacity

    def set_rows(self, io: ort.IOBinding, lengths: list[int]) -> None:
        # Bound for good already (`bind`). A batch's mask is rewritten whole each step and
        # never takes `set` (whose host copy covers one row).
        self._write_rows(lengths, self.capacity)


_KINDS: dict[MaskPolicy, type[AttentionMask]] = {
    MaskPolicy.LOGICAL: LogicalMask,
    MaskPolicy.CAPACITY: CapacityMask,
}


def mask_kind(policy: MaskPolicy) -> type[AttentionMask]:
    """The mask class of `policy`, chosen once per runtime."""
    return _KINDS[MaskPolicy(policy)]


def decode_mask(lengths: list[int], width: int, dtype: np.dtype) -> np.ndarray:
    """The [rows, width] attention mask of a decode step: row i has lengths[i] + 1 ones."""
    columns = np.arange(width)
    return (columns[None, :] <= np.asarray(lengths)[:, None]).astype(dtype)
