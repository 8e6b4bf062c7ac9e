"""Raw copies and fills of device memory at byte offsets: the CPU's memmove and memset, CUDA's
cudaMemcpy and cudaMemset through the CUDA runtime ONNX Runtime maps (`memory.cudart`).

Every CUDA call here holds the capture gate shared (`capture_gate`): a synchronous copy or fill
from another thread would invalidate a CUDA graph capture under way. Errors of the CUDA runtime
are `ProviderError`s naming the bytes and the code.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np
import onnxruntime as ort

from onnx_chunk.errors import ProviderError
from onnx_chunk.runtime.device.capture_gate import CAPTURE_GATE
from onnx_chunk.runtime.device.memory import cudart

logger = logging.getLogger(__name__)

_CUDA_MEMCPY_HOST_TO_DEVICE = 1
_CUDA_MEMCPY_DEVICE_TO_HOST = 2
_CUDA_MEMCPY_DEVICE_TO_DEVICE = 3


def zero_on_device(value: ort.OrtValue, nbytes: int) -> None:
    """memset (CPU) or cudaMemset (CUDA) `nbytes` of `value` to zero."""
    if nbytes == 0:
        return
    device = value.device_name().lower()
    if device == "cpu":
        ctypes.memset(value.data_ptr(), 0, nbytes)
        return
    library = _cuda_memset() if device == "cuda" else None
    if library is None:
        raise ProviderError(f"no memset on {device}; the runtime supports CPU and CUDA devices")
    with CAPTURE_GATE.shared():
        status = library(value.data_ptr(), 0, nbytes)
    if status != 0:
        raise ProviderError(f"zeroing {nbytes} bytes on the GPU failed (CUDA error {status}); "
                            "the device is in a bad state, restart the process")


def copy_to_device(value: ort.OrtValue, offset: int, data: np.ndarray) -> None:
    """Copy `data` into `value`'s memory from `offset` bytes on."""
    target = value.data_ptr() + offset
    device = value.device_name().lower()
    if device == "cpu":
        ctypes.memmove(target, data.ctypes.data, data.nbytes)
        return
    memcpy = _cuda_memcpy() if device == "cuda" else None
    if memcpy is None:
        raise ProviderError(f"no partial copy into {device} memory; the runtime supports CPU "
                            "and CUDA devices")
    with CAPTURE_GATE.shared():
        status = memcpy(target, data.ctypes.data, data.nbytes, _CUDA_MEMCPY_HOST_TO_DEVICE)
    if status != 0:
        raise ProviderError(f"copying {data.nbytes} bytes to the GPU failed (CUDA error "
                            f"{status}); the device is in a bad state, restart the process")


def copy_to_host(value: ort.OrtValue, offset: int, out: np.ndarray) -> None:
    """Copy `out.nbytes` bytes from `offset` bytes into `value`'s memory into `out`."""
    if out.nbytes == 0:
        return
    source = value.data_ptr() + offset
    device = value.device_name().lower()
    if device == "cpu":
        ctypes.memmove(out.ctypes.data, source, out.nbytes)
        return
    memcpy = _cuda_memcpy() if device == "cuda" else None
    if memcpy is None:
        logger.debug("no partial copy from %s memory; copying the whole buffer", device)
        whole = value.numpy().reshape(-1).view(np.uint8)  # counted as the part asked for
        out.view(np.uint8)[...] = whole[offset:offset + out.nbytes]
        return
    with CAPTURE_GATE.shared():
        status = memcpy(out.ctypes.data, source, out.nbytes, _CUDA_MEMCPY_DEVICE_TO_HOST)
    if status != 0:
        raise ProviderError(f"copying {out.nbytes} bytes of logits from the GPU failed (CUDA "
                            f"error {status}); the device is in a bad state, restart the process")


def copy_between(target: ort.OrtValue, target_offset: int, source: ort.OrtValue,
                 source_offset: int, nbytes: int) -> None:
    """Copy `nbytes` from `source`'s memory at `source_offset` into `target`'s at
    `target_offset`, on their one device (never through the host)."""
    destination = target.data_ptr() + target_offset
    origin = source.data_ptr() + source_offset
    device = target.device_name().lower()
    if device == "cpu":
        ctypes.memmove(destination, origin, nbytes)
        return
    memcpy = _cuda_memcpy() if device == "cuda" else None
    if memcpy is None:
        raise ProviderError(f"no device-to-device copy on {device}; the runtime supports CPU "
                            "and CUDA devices")
    with CAPTURE_GATE.shared():
        status = memcpy(destination, origin, nbytes, _CUDA_MEMCPY_DEVICE_TO_DEVICE)
    if status != 0:
        raise ProviderError(f"copying {nbytes} bytes of KV cache on the GPU failed (CUDA error "
                            f"{status}); the device is in a bad state, restart the process")


@functools.cache
def _cuda_function(name: str, *argtypes: type):
    """`name` of the CUDA runtime the memory readings use (returning a cudaError_t int), or
    None without one."""
    library = cudart()
    if library is None:
        return None
    function = getattr(library, name)
    function.restype = ctypes.c_int
    function.argtypes = list(argtypes)
    return function


def _cuda_memset():
    """cudaMemset(pointer, value, bytes), or None without a CUDA runtime."""
    return _cuda_function("cudaMemset", ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)


def _cuda_memcpy():
    """cudaMemcpy(target, source, bytes, kind), or None without a CUDA runtime."""
    return _cuda_function("cudaMemcpy", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                          ctypes.c_int)
