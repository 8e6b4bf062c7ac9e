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
   fixed shape: what CUDA graphs replay); ones for the valid prefix, zeros after. Every
   forward changes only the columns that change, row by row (a decode step: one element per
   row that stepped), on the device: ones are copied from a row of ones kept beside the
   buffer (written once), zeros are set in place; a reset zeroes the buffer. No mask update
   crosses from the host.
"""

from __future__ import annotations

import abc

import numpy as np
import onnxruntime as ort

from onnx_chunk.runtime.device.buffers import copy_on_device, device_zeros, zero_range
from onnx_chunk.runtime.device.provider import Device, MaskPolicy
from onnx_chunk.runtime.state.ports import MASK_INPUT


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
        # How many leading ones each row holds, and a row of ones to copy them from.
        self._ones = [0] * rows
        self._source = device_zeros((1, capacity), dtype, device)
        self._source.write(np.ones((1, capacity), dtype=dtype))

    def reset(self) -> None:
        self._ones = [0] * self.rows
        self.buffer.zero()

    def bind(self, io: ort.IOBinding) -> None:
        io.bind_ortvalue_input(MASK_INPUT, self.buffer.value)

    def set(self, io: ort.IOBinding, end: int) -> None:
        self._set_row(0, end)

    def width(self, lengths: list[int]) -> int:
        return self.capacity

    def set_rows(self, io: ort.IOBinding, lengths: list[int]) -> None:
        # Bound for good already (`bind`): each row's changed columns only.
        for row, length in enumerate(lengths):
            self._set_row(row, length + 1)

    def _set_row(self, row: int, end: int) -> None:
        """Row `row`: columns [0, end) ones, the rest zeros; only the columns that change are
        written, on the device."""
        ones = self._ones[row]
        base = row * self.capacity
        if end > ones:
            copy_on_device(self.buffer, base + ones, self._source, ones, end - ones)
        elif end < ones:
            zero_range(self.buffer, base + end, base + ones)
        self._ones[row] = end


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
