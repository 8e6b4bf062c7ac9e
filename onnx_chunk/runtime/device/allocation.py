"""Device buffers the runtime owns: allocated by what they need, freed with their last user.

Why not ONNX Runtime's Python CUDA allocator: `OrtValue.ortvalue_from_shape_and_type(...,
"cuda")` takes memory from one process-wide BFC arena per device
(onnxruntime/python/onnxruntime_pybind_state_common.cc, `GetCudaAllocator`, created once with
the deprecated global `arena_extend_strategy` = kNextPowerOfTwo and no setting the Python API
exposes), which grows to the next power of two and never gives memory back: KV could take up
to twice its size, and a closed runtime's buffers stay in the arena for the rest of the
process. ONNX Runtime's per-session allocator (the one the provider options configure) hands
Python nothing but a run's outputs, which move from run to run.

So the runtime allocates its fixed buffers itself, exactly at their size (cudaMalloc through
the CUDA runtime the memory readings load; on the CPU device path, malloc), zeroes them on the
device (cudaMemset: no host copy), and hands ONNX Runtime an OrtValue over that memory through
DLPack (`OrtValue.from_dlpack`, onnxruntime_pybind_mlvalue.cc / dlpack_converter.cc): no copy,
and the DLPack deleter frees the memory when ONNX Runtime drops its last reference (the
IOBindings and sessions of a closed runtime included), so `Runtime.close()` gives the device
memory back and a second runtime inherits nothing. Where the installed ONNX Runtime has no
DLPack import, or the memory cannot be had so, the buffer comes from ONNX Runtime's allocator
as before (logged once).

Device work and captures: the allocation (cudaMalloc, cudaMemset) holds the capture gate
shared, and the deleter's cudaFree runs outside any other thread's capture (deferred to the
capture's end when one is under way): CUDA's global capture mode fails on either from another
thread (`capture_gate`). The CUDA runtime is the one ONNX Runtime maps (`memory.cudart`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading

import numpy as np
import onnxruntime as ort

from onnx_chunk.runtime.device.capture_gate import CAPTURE_GATE
from onnx_chunk.runtime.device.memory import cudart

logger = logging.getLogger(__name__)

_KDL_CPU, _KDL_CUDA = 1, 2
_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_BOOL = 0, 1, 2, 6


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", _DELETER)]


class Allocations:
    """Bytes the runtime's own buffers hold now (process-wide), and how many were freed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live_bytes = 0
        self.live_buffers = 0
        self.freed_buffers = 0

    def added(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes += nbytes
            self.live_buffers += 1

    def removed(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes
            self.live_buffers -= 1
            self.freed_buffers += 1


ALLOCATIONS = Allocations()
# What each managed tensor keeps alive until its deleter runs: (struct, shape, free, nbytes).
_HELD: dict[int, tuple[object, object, object, int]] = {}


@_DELETER
def _delete(managed: ctypes._Pointer) -> None:  # type: ignore[type-arg]
    address = ctypes.addressof(managed.contents)
    held = _HELD.pop(address, None)
    if held is None or sys.is_finalizing():  # the process frees its memory as it exits
        return
    _, _, free, nbytes = held
    pointer = managed.contents.dl_tensor.data

    def release() -> None:
        free(pointer)  # type: ignore[operator]
        ALLOCATIONS.removed(nbytes)

    CAPTURE_GATE.outside_capture(release)


def _dl_dtype(dtype: np.dtype) -> _DLDataType | None:
    code = {"f": _KDL_FLOAT, "i": _KDL_INT, "u": _KDL_UINT, "b": _KDL_BOOL}.get(dtype.kind)
    return None if code is None else _DLDataType(code, dtype.itemsize * 8, 1)


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    library = ctypes.CDLL(None)
    library.malloc.restype = ctypes.c_void_p
    library.malloc.argtypes = [ctypes.c_size_t]
    library.free.argtypes = [ctypes.c_void_p]
    library.memset.restype = ctypes.c_void_p
    library.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return library


@functools.lru_cache(maxsize=1)
def _cuda() -> ctypes.CDLL | None:
    library = cudart()
    if library is None:
        return None
    library.cudaMalloc.restype = ctypes.c_int
    library.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    library.cudaFree.restype = ctypes.c_int
    library.cudaFree.argtypes = [ctypes.c_void_p]
    library.cudaMemset.restype = ctypes.c_int
    library.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return library


def _allocate(device_type: str, device_id: int, nbytes: int):
    """(pointer, free, DLPack device type) of `nbytes` zeroed bytes, or None."""
    if device_type == "cpu":
        libc = _libc()
        pointer = libc.malloc(max(nbytes, 1))
        if not pointer:
            return None
        libc.memset(pointer, 0, nbytes)
        return pointer, libc.free, _KDL_CPU
    if device_type != "cuda":
        return None
    library = _cuda()
    if library is None:
        return None
    previous = ctypes.c_int(0)
    library.cudaGetDevice(ctypes.byref(previous))
    library.cudaSetDevice(device_id)
    try:
        pointer = ctypes.c_void_p()
        if library.cudaMalloc(ctypes.byref(pointer), max(nbytes, 1)) != 0 or not pointer.value:
            return None
        if library.cudaMemset(pointer, 0, nbytes) != 0:
            library.cudaFree(pointer)
            return None
    finally:
        library.cudaSetDevice(previous.value)
    return pointer.value, library.cudaFree, _KDL_CUDA


def owned_zeros(shape: tuple[int, ...], dtype: np.dtype, device_type: str,
                device_id: int) -> ort.OrtValue | None:
    """A zeroed OrtValue over memory the runtime allocated for it alone (see the module
    docstring), or None where that cannot be had (the caller takes ONNX Runtime's)."""
    if not _dlpack_import():
        return None
    dl_dtype = _dl_dtype(np.dtype(dtype))
    if dl_dtype is None:
        return None
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    with CAPTURE_GATE.shared():
        allocated = _allocate(device_type, device_id, nbytes)
        if allocated is not None:
            ALLOCATIONS.added(nbytes)
    if allocated is None:
        note_fallback(f"no {device_type} allocation through the CUDA runtime")
        return None
    pointer, free, kind = allocated
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(pointer, _DLDevice(kind, device_id), len(shape), dl_dtype,
                                  dims, None, 0)
    managed.manager_ctx = None
    managed.deleter = _delete
    _HELD[ctypes.addressof(managed)] = (managed, dims, free, nbytes)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    try:
        return ort.OrtValue.from_dlpack(new_capsule(ctypes.addressof(managed), b"dltensor",
                                                    None))
    except Exception as error:  # ORT's own exception types: this build imports no DLPack
        _HELD.pop(ctypes.addressof(managed), None)
        with CAPTURE_GATE.shared():
            free(pointer)
            ALLOCATIONS.removed(nbytes)
        note_fallback(f"OrtValue.from_dlpack refused it: {error}")
        return None


def _dlpack_import() -> bool:
    return callable(getattr(ort.OrtValue, "from_dlpack", None))


@functools.cache
def note_fallback(reason: str) -> None:
    """Log, once per reason and process (`note_fallback.cache_clear()` logs again), that device
    buffers come from ONNX Runtime's allocator."""
    logger.warning("device buffers come from ONNX Runtime's process-wide allocator (%s); "
                   "Runtime.close() returns them to its arena, not to the device", reason)
