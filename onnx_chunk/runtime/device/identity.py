"""Whether ONNX Runtime binds the runtime's own buffers in place, checked once per device.

`IOBinding.bind_ortvalue_input` copies a value whose `OrtDevice` differs from the one the
session's provider expects, at bind time (`IOBinding::BindInput` through
`utils::CopyOneInputAcrossDevices`; measured on the 1.26-1.32 CPU wheels: binding a DLPack
value on `kDLCUDA` into a CPU session fails in bind_ortvalue_input with "no data transfer
registered for copying tensors from Device:[DeviceType:1 ... VendorId:4318 ...]"). Since
1.23 `OrtDevice` carries a PCI vendor id and compares it (include/onnxruntime/core/framework/
ortdevice.h, `operator==`); the CUDA provider's memory is NVIDIA's (0x10DE). A buffer the
runtime allocated and imported through DLPack (`allocation.owned_zeros`) whose device differed
would be bound as a snapshot: a decode would read a stale past while its present is written
into the real buffer, and past and present would no longer share memory.

So before the first owned buffer of a device is used, `binds_in_place` binds two owned
buffers to a one-node model (Identity, `provider.PROBE_MODEL`) on that device's provider,
writes the input after binding it, runs, and reads the output: the new value comes out only
when ONNX Runtime bound the buffer itself. Where it does not, the device's buffers come from
ONNX Runtime's own allocator (`buffers.device_zeros`), with a warning; the answer is kept per
device and process.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import onnxruntime as ort

from onnx_chunk.runtime.device.allocation import owned_zeros
from onnx_chunk.runtime.device.capture_gate import CAPTURE_GATE
from onnx_chunk.runtime.device.copies import copy_to_device, copy_to_host
from onnx_chunk.runtime.device.provider import PROBE_MODEL, Device

logger = logging.getLogger(__name__)

_MARK = 7.0
_LOCK = threading.Lock()
_CHECKED: dict[tuple, bool] = {}


def binds_in_place(device: Device) -> bool:
    """Whether owned buffers of `device` are bound in place (the module docstring)."""
    key = _key(device)
    known = _CHECKED.get(key)
    if known is not None:
        return known
    # Checked without a lock held (two threads may both check once): the check waits for the
    # capture gate, which a capturing thread that asks here would hold.
    failure = bind_time_copy(device)
    with _LOCK:
        if key not in _CHECKED and failure is not None:
            logger.warning("the runtime's own %s buffers are not used: %s; they come from ONNX "
                           "Runtime's allocator instead", device.label, failure)
        return _CHECKED.setdefault(key, failure is None)


def record(device: Device, in_place: bool) -> None:
    """Take `in_place` as the answer for `device` (the GPU check compares the runtime's own
    buffers with ONNX Runtime's allocator's on one device)."""
    with _LOCK:
        _CHECKED[_key(device)] = in_place


def forget() -> None:
    """Check every device again at its next buffer (a test that changes how binding behaves)."""
    with _LOCK:
        _CHECKED.clear()


def _key(device: Device) -> tuple:
    return (device.device_type, device.device_id,
            tuple((name, tuple(sorted(options.items())))
                  for name, options in device.session_providers))


def bind_time_copy(device: Device) -> str | None:
    """None when an owned buffer bound as an input is read in place by a session on `device`;
    else what happened (no owned buffer, a copy at bind time, a failed run)."""
    source = owned_zeros((1,), np.dtype(np.float32), device.device_type, device.device_id)
    target = owned_zeros((1,), np.dtype(np.float32), device.device_type, device.device_id)
    if source is None or target is None:
        return "no buffer of the runtime's own could be allocated"
    try:
        with CAPTURE_GATE.shared():
            session = ort.InferenceSession(PROBE_MODEL, providers=device.providers())
        binding = session.io_binding()
        binding.bind_ortvalue_input("x", source)
        binding.bind_ortvalue_output("y", target)
        copy_to_device(source, 0, np.full(1, _MARK, dtype=np.float32))
        device.run(session, binding, None)
        seen = np.zeros(1, dtype=np.float32)
        copy_to_host(target, 0, seen)
    except Exception as error:  # ORT's own exception types
        return f"binding an owned buffer failed ({type(error).__name__}: {error})"
    if seen[0] != _MARK:
        return (f"ONNX Runtime {ort.__version__} copied an owned buffer when it was bound (its "
                f"device differs from the session's), so a run read {seen[0]} instead of "
                f"{_MARK}")
    return None
