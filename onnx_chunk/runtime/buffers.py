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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from onnx_chunk.runtime.ports import BufferPort
from onnx_chunk.runtime.provider import Device


@dataclass(frozen=True)
class DeviceBuffer:
    """An OrtValue on the runtime's device, and its host view where the device has one."""

    value: ort.OrtValue
    host: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return int(self.value.tensor_size_in_bytes())


def device_zeros(shape: tuple[int, ...], dtype: np.dtype, device: Device) -> DeviceBuffer:
    """A zero-filled buffer allocated once on `device`."""
    if device.host_visible:
        host = np.zeros(shape, dtype=dtype)
        return DeviceBuffer(ort.OrtValue.ortvalue_from_numpy(host), host)
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.dtype(dtype).type,
                                                      device.device_type, device.device_id)
    value.update_inplace(np.zeros(shape, dtype=dtype))
    return DeviceBuffer(value, None)


class SequenceBuffers:
    """The KV and state buffers of one sequence (see the module docstring)."""

    def __init__(self, kv: tuple[BufferPort, ...], state: tuple[BufferPort, ...],
                 device: Device) -> None:
        self.kv_ports = kv
        self.state_ports = state
        self.kv = tuple(device_zeros(port.shape, port.dtype, device) for port in kv)
        self._state = tuple((device_zeros(port.shape, port.dtype, device),
                             device_zeros(port.shape, port.dtype, device)) for port in state)
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

    def swap_state(self) -> None:
        """After a successful forward: the buffers just written hold the current state."""
        self._current = 1 - self._current

    def state(self, index: int) -> DeviceBuffer:
        """The buffer holding the current value of state `index`."""
        return self._state[index][self._current]

    def snapshot_state(self) -> tuple[np.ndarray, ...]:
        """Host copies of the current states (taken once per prefill call, never per step)."""
        return tuple(_read(self.state(index)).copy() for index in range(len(self.state_ports)))

    def restore_state(self, snapshot: tuple[np.ndarray, ...]) -> None:
        """Put back the states of `snapshot_state` (a prefill that failed partway)."""
        for index, array in enumerate(snapshot):
            buffer = self.state(index)
            if buffer.host is not None:
                buffer.host[...] = array
            else:
                buffer.value.update_inplace(array)

    def reset_state(self) -> None:
        """Zero every state (a fresh sequence)."""
        for port, pair in zip(self.state_ports, self._state):
            for buffer in pair:
                if buffer.host is not None:
                    buffer.host[...] = 0
                else:
                    buffer.value.update_inplace(np.zeros(port.shape, dtype=port.dtype))


def _read(buffer: DeviceBuffer) -> np.ndarray:
    return buffer.host if buffer.host is not None else buffer.value.numpy()
