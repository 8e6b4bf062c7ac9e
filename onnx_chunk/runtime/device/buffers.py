"""A sequence's device buffers: KV at capacity shared by past and present, state ping-pong.

KV: each `past_key_values.*` input gets one buffer, allocated once at capacity, and the same
OrtValue is bound as its `present.*` output. GQA writes the new rows into the buffer in place
(it sees past and present share memory) and reads the valid prefix through the mask, so no
step copies or reallocates KV.

Recurrent state (conv or SSM state): an operator reads the old state while it writes the new
one, and nothing guarantees that it reads every element before overwriting it, so one buffer
cannot be both input and output. Each state gets two buffers instead: a forward reads from one
and writes into the other, and the roles swap after it succeeds. No step copies state, and a
forward that fails leaves the old state where it was.

Host traffic: a buffer is written with `write` (on a device without a host view,
`OrtValue.update_inplace`: a host-to-device copy into the same memory, so its address never
changes, which CUDA graphs need) and read with `read`, which copies only the elements asked for
(on CUDA a cudaMemcpy of that range from the buffer's device address; the Python API of ONNX
Runtime copies only whole OrtValues). A device without a host view whose memory the host can
still address (the CPU device marked not host-visible, which tests the CUDA path on CPU) reads
with a plain memory copy from the same address.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from onnx_chunk.runtime.device.allocation import owned_zeros
from onnx_chunk.runtime.device.capture_gate import CAPTURE_GATE
from onnx_chunk.runtime.device.copies import (
    copy_between,
    copy_to_device,
    copy_to_host,
    zero_on_device,
)
from onnx_chunk.runtime.device.identity import binds_in_place
from onnx_chunk.runtime.device.provider import Device
from onnx_chunk.runtime.device.transfers import Transfers
from onnx_chunk.runtime.state.ports import BufferPort

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class DeviceBuffer:
    """An OrtValue on the runtime's device, and its host view where the device has one.

    `transfers`: where its host-device copies are counted (its device's; None: uncounted)."""

    value: ort.OrtValue
    host: np.ndarray | None
    dtype: np.dtype
    transfers: Transfers | None = None

    @property
    def nbytes(self) -> int:
        return int(self.value.tensor_size_in_bytes())

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape())

    def write(self, array: np.ndarray) -> None:
        """Copy `array` (the buffer's shape) into the buffer, in place."""
        if self.host is not None:
            self.host[...] = array
        else:
            data = np.ascontiguousarray(array, dtype=self.dtype)
            with CAPTURE_GATE.shared():
                self.value.update_inplace(data)
            self._sent(data.nbytes)

    def zero(self) -> None:
        """Zero the whole buffer on its device (nothing crosses from the host)."""
        if self.host is not None:
            self.host[...] = 0
        else:
            zero_on_device(self.value, self.nbytes)

    def _sent(self, nbytes: int) -> None:
        if self.transfers is not None:
            self.transfers.to_device(nbytes)

    def _received(self, nbytes: int) -> None:
        if self.transfers is not None:
            self.transfers.to_host(nbytes)

    def write_range(self, array: np.ndarray, start: int, stop: int) -> None:
        """Copy flat elements [start, stop) of `array` (the buffer's shape) into the buffer.

        Only those elements cross to the device (one cudaMemcpy on CUDA); the rest of the
        buffer is left as it is.
        """
        if stop <= start:
            return
        flat = np.ascontiguousarray(array, dtype=self.dtype).reshape(-1)
        if self.host is not None:
            self.host.reshape(-1)[start:stop] = flat[start:stop]
            return
        copy_to_device(self.value, start * self.dtype.itemsize, flat[start:stop])
        self._sent((stop - start) * self.dtype.itemsize)

    def read(self, start: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
        """`count` elements from flat index `start`, on the host (a view where there is one;
        else copied into `out` when given, so a hot loop allocates nothing)."""
        if start < 0 or count < 0 or start + count > self.value.tensor_size_in_bytes() // \
                self.dtype.itemsize:
            raise ValueError(f"elements [{start}, {start + count}) are outside a buffer of shape "
                             f"{list(self.shape)}")
        if self.host is not None:
            return self.host.reshape(-1)[start:start + count]
        if out is None:
            out = np.empty(count, dtype=self.dtype)
        copy_to_host(self.value, start * self.dtype.itemsize, out)
        self._received(out.nbytes)
        return out


def device_zeros(shape: tuple[int, ...], dtype: np.dtype, device: Device) -> DeviceBuffer:
    """A zero-filled buffer allocated once on `device`: off the host, memory the runtime owns
    (`allocation.owned_zeros`: exactly its size, freed with its last user), where ONNX Runtime
    binds such a buffer in place (`identity.binds_in_place`), else from ONNX Runtime's allocator.
    Every allocation and copy off the host holds the capture gate shared (`capture_gate`)."""
    dtype = np.dtype(dtype)
    if device.host_visible:
        host = np.zeros(shape, dtype=dtype)
        return DeviceBuffer(ort.OrtValue.ortvalue_from_numpy(host), host, dtype,
                            device.transfers)
    owned = (owned_zeros(shape, dtype, device.device_type, device.device_id)
             if binds_in_place(device) else None)
    if owned is not None:
        return DeviceBuffer(owned, None, dtype, device.transfers)
    with CAPTURE_GATE.shared():
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype.type,
                                                          device.device_type, device.device_id)
    buffer = DeviceBuffer(value, None, dtype, device.transfers)
    buffer.zero()
    return buffer


def copy_on_device(target: DeviceBuffer, target_start: int, source: DeviceBuffer,
                   source_start: int, count: int) -> None:
    """Copy `count` flat elements of `source` from `source_start` into `target` from
    `target_start`: two buffers (or two parts of one) on one device, same dtype, not
    overlapping, never through the host (a memory copy on CPU, cudaMemcpy device to device on
    CUDA)."""
    if count <= 0:
        return
    itemsize = source.dtype.itemsize
    copy_between(target.value, target_start * itemsize, source.value, source_start * itemsize,
                 count * itemsize)


class SequenceBuffers:
    """The KV and state buffers of one sequence (see the module docstring)."""

    def __init__(self, kv: tuple[BufferPort, ...], state: tuple[BufferPort, ...],
                 device: Device, rows: int = 1) -> None:
        """`rows`: the batch rows of every buffer (1 for a sequence of its own)."""
        self.kv_ports = kv
        self.state_ports = state
        self.kv = tuple(device_zeros(_rows(port.shape, rows), port.dtype, device) for port in kv)
        self._state = tuple((device_zeros(_rows(port.shape, rows), port.dtype, device),
                             device_zeros(_rows(port.shape, rows), port.dtype, device))
                            for port in state)
        self._current = 0

    @property
    def nbytes(self) -> int:
        """Bytes held on the device by this sequence's buffers."""
        return (sum(buffer.nbytes for buffer in self.kv)
                + sum(a.nbytes + b.nbytes for a, b in self._state))

    def bind_kv(self, binding: ort.IOBinding) -> None:
        """Bind every KV buffer as its past input and its present output."""
        for port, buffer in zip(self.kv_ports, self.kv):
            binding.bind_ortvalue_input(port.input, buffer.value)
            binding.bind_ortvalue_output(port.output, buffer.value)

    def bind_state(self, binding: ort.IOBinding) -> None:
        """Bind each state's current buffer as input and its other buffer as output."""
        for port, pair in zip(self.state_ports, self._state):
            binding.bind_ortvalue_input(port.input, pair[self._current].value)
            binding.bind_ortvalue_output(port.output, pair[1 - self._current].value)

    @property
    def parity(self) -> int:
        """Which of each state's two buffers holds the current state (0 or 1)."""
        return self._current

    def swap_state(self) -> None:
        """After a successful forward: the buffers just written hold the current state."""
        self._current = 1 - self._current

    def state(self, index: int) -> DeviceBuffer:
        """The buffer holding the current value of state `index`."""
        return self._state[index][self._current]

    def snapshot_state(self) -> tuple[np.ndarray, ...]:
        """Host copies of the current states (taken once per prefill call, never per step:
        what a prefill that fails partway puts back)."""
        return tuple(_read(self.state(index)) for index in range(len(self.state_ports)))

    def restore_state(self, snapshot: tuple[np.ndarray, ...]) -> None:
        """Put back the states of `snapshot_state` (a prefill that failed partway)."""
        for index, array in enumerate(snapshot):
            self.state(index).write(array)

    def reset_state(self) -> None:
        """Zero every state (a fresh sequence), on the device."""
        for pair in self._state:
            for buffer in pair:
                buffer.zero()


class BatchBuffers(SequenceBuffers):
    """The KV and state buffers of `slots` sequences, one allocation per port: [slots, ...].

    Row `i` of every buffer is slot `i`'s. A batched decode binds the whole buffers (every slot
    one row of the forward: `bind_kv`, `bind_state`); a slot's own forwards (its prefill
    chunks) bind `slot(i)`, a [1, ...] view of its row at the row's address, so the prefill
    writes in place into the same memory the decode reads. Which of a state's two buffers
    holds the current state is the same for every row (`parity`), so a slot's own forward
    copies its new state row back into the current buffer (`SlotBuffers.swap_state`), and a
    batched forward copies the old state back for rows that did not really step
    (`keep_state`).
    """

    def __init__(self, kv: tuple[BufferPort, ...], state: tuple[BufferPort, ...],
                 device: Device, slots: int) -> None:
        super().__init__(kv, state, device, rows=slots)
        self.slots = slots
        self.device = device
        # Device rows saved by `save_row`, allocated once per (buffer, row) that needs one.
        self._scratch: dict[tuple[int, int], DeviceBuffer] = {}
        # How many rows `save_row` has copied (none where every forward is native).
        self.saved_rows = 0

    def slot(self, index: int) -> SlotBuffers:
        """Slot `index`'s view, bound by its own forwards."""
        if not 0 <= index < self.slots:
            raise ValueError(f"slot {index} is outside [0, {self.slots})")
        return SlotBuffers(self, index)

    def keep_state(self, rows: list[int]) -> None:
        """After a batched forward, before `swap_state`: `rows` keep their state as it was."""
        for pair in self._state:
            old, new = pair[self._current], pair[1 - self._current]
            for row in rows:
                _copy_row(old, new, row)

    def state_pair(self, index: int) -> tuple[DeviceBuffer, DeviceBuffer]:
        """State `index`'s (current, other) buffers."""
        pair = self._state[index]
        return pair[self._current], pair[1 - self._current]

    def row_range(self, buffer: DeviceBuffer, row: int) -> tuple[int, int]:
        """Row `row` of `buffer` as flat elements [start, stop)."""
        per_row = int(np.prod(buffer.shape[1:], dtype=np.int64))
        return row * per_row, (row + 1) * per_row

    def read_row(self, buffer: DeviceBuffer, row: int) -> np.ndarray:
        """A host copy of row `row` of `buffer`."""
        start, stop = self.row_range(buffer, row)
        return np.array(buffer.read(start, stop - start)).reshape((1, *buffer.shape[1:]))

    def copy_slot(self, source: int, target: int) -> None:
        """Make slot `target`'s KV and current state rows a copy of slot `source`'s, on the
        device (`copy_on_device`): a sequence forked after its prefill."""
        for buffer in (*self.kv, *(pair[self._current] for pair in self._state)):
            start, stop = self.row_range(buffer, source)
            copy_on_device(buffer, self.row_range(buffer, target)[0], buffer, start,
                           stop - start)

    def write_row(self, buffer: DeviceBuffer, row: int,
                  array: np.ndarray | DeviceBuffer) -> None:
        """Copy `array` (one row: a host array, or a row saved on the device by `save_row`)
        into row `row` of `buffer`."""
        start, stop = self.row_range(buffer, row)
        if isinstance(array, DeviceBuffer):
            copy_on_device(buffer, start, array, 0, stop - start)
            return
        _write_flat(buffer, start, np.ascontiguousarray(array, dtype=buffer.dtype).reshape(-1))

    def save_row(self, buffer: DeviceBuffer, row: int) -> DeviceBuffer:
        """A device copy of row `row` of `buffer` (a window-sized cache's row that an idle
        row's forward would evict), in a scratch row kept per (buffer, row) and reused: it
        never crosses to the host. `write_row` puts it back."""
        key = (id(buffer), row)
        scratch = self._scratch.get(key)
        if scratch is None:
            scratch = self._scratch[key] = device_zeros((1, *buffer.shape[1:]), buffer.dtype,
                                                        self.device)
        start, stop = self.row_range(buffer, row)
        copy_on_device(scratch, 0, buffer, start, stop - start)
        self.saved_rows += 1
        return scratch


class SlotBuffers:
    """One slot of a `BatchBuffers`: the interface of `SequenceBuffers` over row `index`.

    KV and state are bound by address with a [1, ...] shape (`IOBinding.bind_input` and
    `bind_output` with a buffer pointer), so a forward writes straight into the slot's row.
    `parity` is always 0 for the forward's own view: it reads the current buffer's row and
    writes the other's, and `swap_state` copies that row back into the current buffer.
    """

    def __init__(self, batch: BatchBuffers, index: int) -> None:
        self.batch = batch
        self.index = index
        self.kv_ports = batch.kv_ports
        self.state_ports = batch.state_ports
        self.parity = 0

    @property
    def nbytes(self) -> int:
        """Bytes of this slot's rows."""
        return self.batch.nbytes // self.batch.slots

    def bind_kv(self, binding: ort.IOBinding) -> None:
        for port, buffer in zip(self.kv_ports, self.batch.kv):
            self._bind(binding, port.input, port.output, buffer, buffer)

    def bind_state(self, binding: ort.IOBinding) -> None:
        for index, port in enumerate(self.state_ports):
            current, other = self.batch.state_pair(index)
            self._bind(binding, port.input, port.output, current, other)

    def swap_state(self) -> None:
        """After this slot's forward: its new state row becomes the current one."""
        for index in range(len(self.state_ports)):
            current, other = self.batch.state_pair(index)
            _copy_row(other, current, self.index)

    def snapshot_state(self) -> tuple[np.ndarray, ...]:
        """Host copies of this slot's current states."""
        return tuple(self.batch.read_row(self.batch.state_pair(index)[0], self.index)
                     for index in range(len(self.state_ports)))

    def restore_state(self, snapshot: tuple[np.ndarray, ...]) -> None:
        for index, array in enumerate(snapshot):
            self.batch.write_row(self.batch.state_pair(index)[0], self.index, array)

    def reset_state(self) -> None:
        """Zero this slot's rows of every state (both buffers), on the device."""
        for index in range(len(self.state_ports)):
            for buffer in self.batch.state_pair(index):
                start, stop = self.batch.row_range(buffer, self.index)
                zero_range(buffer, start, stop)

    def _bind(self, binding: ort.IOBinding, input_name: str, output_name: str,
              source: DeviceBuffer, target: DeviceBuffer) -> None:
        device = self.batch.device
        shape = [1, *source.shape[1:]]
        start, _ = self.batch.row_range(source, self.index)
        offset = start * source.dtype.itemsize
        binding.bind_input(input_name, device.device_type, device.device_id, source.dtype,
                           shape, source.value.data_ptr() + offset)
        binding.bind_output(output_name, device.device_type, device.device_id, target.dtype,
                            shape, target.value.data_ptr() + offset)


def _read(buffer: DeviceBuffer) -> np.ndarray:
    """A host copy of the whole buffer (counted)."""
    size = buffer.nbytes // buffer.dtype.itemsize
    return np.array(buffer.read(0, size)).reshape(buffer.shape)


def _rows(shape: tuple[int, ...], slots: int) -> tuple[int, ...]:
    """`shape` (batch 1) with `slots` rows."""
    return (slots, *shape[1:])


def _write_flat(buffer: DeviceBuffer, start: int, flat: np.ndarray) -> None:
    """Copy `flat` into `buffer`'s flat elements from `start` on (counted)."""
    if buffer.host is not None:
        buffer.host.reshape(-1)[start:start + flat.size] = flat
        return
    copy_to_device(buffer.value, start * buffer.dtype.itemsize, flat)
    buffer._sent(flat.nbytes)


def zero_range(buffer: DeviceBuffer, start: int, stop: int) -> None:
    """Zero flat elements [start, stop) of `buffer` on its device."""
    if buffer.host is not None:
        buffer.host.reshape(-1)[start:stop] = 0
        return
    itemsize = buffer.dtype.itemsize
    view = _Window(buffer.value, start * itemsize)
    zero_on_device(view, (stop - start) * itemsize)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Window:
    """A byte offset into an OrtValue, read by `copies.zero_on_device` like the OrtValue itself."""

    value: ort.OrtValue
    offset: int

    def data_ptr(self) -> int:
        return int(self.value.data_ptr()) + self.offset

    def device_name(self) -> str:
        return str(self.value.device_name())


def _copy_row(source: DeviceBuffer, target: DeviceBuffer, row: int) -> None:
    """Row `row` of `source` into the same row of `target` (same shape), on the device."""
    per_row = int(np.prod(source.shape[1:], dtype=np.int64))
    if source.host is not None and target.host is not None:
        target.host[row] = source.host[row]
        return
    copy_on_device(target, row * per_row, source, row * per_row, per_row)
