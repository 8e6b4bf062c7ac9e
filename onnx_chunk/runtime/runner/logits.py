"""Reading a forward's logits: only the rows asked for reach the host.

A one-row forward's last row is read alone (off the host into the binding's row buffer); a
batched forward's rows at once. A decoder that returns fewer rows than asked for ("all" of a
decoder that keeps the last row only) is a ModelStructureError naming what to ask for instead.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.runtime.device.buffers import DeviceBuffer
from onnx_chunk.runtime.device.provider import Device
from onnx_chunk.runtime.runner.forward import LogitsRows
from onnx_chunk.runtime.runner.native_chunks import NativePlan


def read_rows(logits: DeviceBuffer, returned: int, real_rows: int, batch: int, need: LogitsRows,
              out: np.ndarray | None, view: bool) -> np.ndarray | None:
    """The rows wanted of `returned` real-row logits per batch row: none, the last or all.

    A one-row forward's last row is read alone (off the host into `out` when given); `view`:
    it may stay a view valid until the next forward of the binding, else it is a copy. A
    batched forward's rows are read at once.
    """
    if need == "none":
        return None
    vocab = logits.shape[-1]
    if need == "last":
        if batch == 1:
            row = logits.read((returned - 1) * vocab, vocab, out)
            return (row if view else np.array(row))[None]
        per_row = logits.shape[1]
        every = logits.read(0, batch * per_row * vocab).reshape(batch, per_row, vocab)
        return np.array(every[:, returned - 1])
    if returned != real_rows:
        raise ModelStructureError(
            f"a forward of {real_rows} rows returned {returned} logits rows: the "
            "decoder does not return every row's logits, so ask for the last row only")
    per_row = logits.shape[1]
    every = logits.read(0, batch * per_row * vocab).reshape(batch, per_row, vocab)
    return np.array(every[:, :returned])


def output_buffer(value: ort.OrtValue, dtype: np.dtype, device: Device) -> DeviceBuffer:
    """An output ONNX Runtime allocated, read through partial copies like any device buffer
    (counted in `device`'s transfers where the host has no view of it)."""
    return DeviceBuffer(value, None, np.dtype(dtype),
                        None if device.host_visible else device.transfers)


def shape_only(buffer: DeviceBuffer) -> np.ndarray:
    return np.broadcast_to(np.zeros((), dtype=buffer.dtype), buffer.shape)


def read_native(logits: DeviceBuffer, plan: NativePlan, rows: int, need: LogitsRows, *,
                selected: bool, chosen: bool, out: np.ndarray | None,
                view: bool) -> np.ndarray | None:
    """The rows wanted of a native forward of `rows` batch rows: none, each row's last real
    row, or (one batch row) every real row. `selected`: a row-selecting session returned the
    last real row alone; `chosen`: the decoder computed only the rows fed to its logits_rows
    input (one per batch row, or every real row)."""
    if need == "none":
        return None
    returned = logits.shape[1]
    if need == "all":
        count = int(plan.query_lens[0])
        if selected or returned < count or (chosen and returned != count):
            raise ModelStructureError(
                f"a forward of {count} rows returned {returned} logits rows: the decoder "
                "does not return every row's logits, so ask for the last row only")
        every = logits.read(0, returned * logits.shape[-1]).reshape(1, returned, -1)
        return np.array(every[:, :count])
    vocab = logits.shape[-1]
    if rows == 1:
        index = 0 if selected or chosen or returned == 1 else int(plan.last_rows[0])
        last = logits.read(index * vocab, vocab, out)
        return (last if view else np.array(last))[None]
    every = logits.read(0, rows * returned * vocab).reshape(rows, returned, vocab)
    picked = np.arange(rows) if chosen else plan.last_rows
    return np.array(every[np.arange(rows), picked])
