"""Memory readings taken from the operating system and the CUDA runtime, never estimated.

The variant cache charges each variant with the bytes its build made the process hold: a meter is
read before and after the build and the difference is kept. On CPU the meter is the process's
resident set; on CUDA it is the device's used memory as `cudaMemGetInfo` reports it (total minus
free, so it sees every allocation on the device, the kernel scratch a variant keeps included).
Readings that the platform cannot give come back as None rather than as a guess.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from onnx_chunk.errors import ConfigError

try:
    import resource
except ImportError:  # Windows has no getrusage: peak_rss_bytes gives no reading there
    resource = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# cudart sonames tried in order; wheels of the nvidia-*-cu1x packages keep theirs under
# site-packages/nvidia/<package>/lib, which the loader does not search by itself.
_CUDART_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")


def process_rss_bytes() -> int | None:
    """The process's resident set size now, in bytes (None where the platform gives no reading).

    Read from /proc/self/statm (resident pages times the page size); without /proc, from psutil
    when it is installed.
    """
    try:
        fields = Path("/proc/self/statm").read_text().split()
    except OSError:
        return _psutil_rss_bytes()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int | None:
    """The process's peak resident set size so far, in bytes (getrusage's ru_maxrss).

    Linux reports ru_maxrss in KiB, macOS in bytes; None on Windows (no getrusage).
    """
    if resource is None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def cuda_used_bytes(device_id: int = 0) -> int | None:
    """Used memory of CUDA device `device_id` (total minus free), or None without a CUDA runtime.

    None when no libcudart can be loaded or when the runtime reports an error (no device, a
    driver too old, an id out of range). The calling thread's current device is restored.
    The first call on a process creates the device's primary context, the one ONNX Runtime's
    CUDA provider shares, so it is inside every later reading.
    """
    library = cudart()
    if library is None:
        return None
    previous = ctypes.c_int(0)
    if library.cudaGetDevice(ctypes.pointer(previous)) != 0:
        return None
    if library.cudaSetDevice(device_id) != 0:
        return None
    try:
        free = ctypes.c_size_t(0)
        total = ctypes.c_size_t(0)
        if library.cudaMemGetInfo(ctypes.pointer(free), ctypes.pointer(total)) != 0:
            return None
        return total.value - free.value
    finally:
        library.cudaSetDevice(previous.value)


class MemoryMeter(Protocol):
    """What the variant cache reads before and after a build (see `measured`)."""

    @property
    def name(self) -> str:
        """What is read, for logs and stats: "rss" or "cuda:<id>"."""
        ...

    def used_bytes(self) -> int | None:
        """The reading now, in bytes; None when the platform gives none."""
        ...


class RssMeter:
    """Reads the process's resident set: what a CPU-provider variant holds lands there."""

    name = "rss"

    def used_bytes(self) -> int | None:
        return process_rss_bytes()


class CudaMeter:
    """Reads one CUDA device's used memory: where a CUDA-provider variant's scratch lands."""

    def __init__(self, device_id: int = 0) -> None:
        self.device_id = device_id
        self.name = f"cuda:{device_id}"

    def used_bytes(self) -> int | None:
        return cuda_used_bytes(self.device_id)


def meter_for(device_type: str, device_id: int = 0) -> MemoryMeter:
    """The meter for the device a provider allocates on: "cpu" -> RssMeter, "cuda" -> CudaMeter."""
    if device_type == "cpu":
        return RssMeter()
    if device_type == "cuda":
        return CudaMeter(device_id)
    raise ConfigError(f"no memory meter for device type {device_type!r}; expected 'cpu' or 'cuda'")


def measured(meter: MemoryMeter, action: Callable[[], T]) -> tuple[T, int | None]:
    """Run `action` and return its result with the bytes the meter grew by meanwhile.

    The growth is clamped at zero (memory other code freed meanwhile is not a credit); None when
    either reading is missing. Readings taken while other threads allocate include their
    allocations: callers serialise the actions they measure.
    """
    before = meter.used_bytes()
    result = action()
    after = meter.used_bytes()
    if before is None or after is None:
        return result, None
    return result, max(0, after - before)


def _psutil_rss_bytes() -> int | None:
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


@functools.lru_cache(maxsize=1)
def cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library, or None where none loads (loaded once per process).

    Tried as `cudart_candidates` lists (by soname, then from the nvidia-* wheels); cudaGetDevice,
    cudaSetDevice and cudaMemGetInfo are declared. Device buffers use it for partial
    device-to-host copies.
    """
    for candidate in cudart_candidates():
        try:
            library = ctypes.CDLL(candidate)
        except OSError:
            continue
        try:
            _declare_cudart(library)
        except AttributeError:
            continue
        logger.debug("CUDA runtime for memory readings: %s", candidate)
        return library
    logger.debug("no CUDA runtime found; device memory readings are unavailable")
    return None


def cudart_candidates() -> list[str]:
    """What `cudart` tries to load, in order: the sonames, then the nvidia-* wheels' copies."""
    return [*_CUDART_NAMES, *_wheel_cudart_paths()]


def _declare_cudart(library: ctypes.CDLL) -> None:
    library.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
    library.cudaSetDevice.argtypes = [ctypes.c_int]
    library.cudaMemGetInfo.argtypes = [ctypes.POINTER(ctypes.c_size_t),
                                       ctypes.POINTER(ctypes.c_size_t)]
    for function in (library.cudaGetDevice, library.cudaSetDevice, library.cudaMemGetInfo):
        function.restype = ctypes.c_int


def _wheel_cudart_paths() -> list[str]:
    found: list[str] = []
    for entry in sys.path:
        nvidia = Path(entry) / "nvidia"
        if nvidia.is_dir():
            found.extend(str(path) for path in sorted(nvidia.glob("*/lib/libcudart.so*")))
    return found
