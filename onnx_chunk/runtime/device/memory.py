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

# ONNX Runtime's CUDA provider library, beside its Python module (onnxruntime-gpu wheels).
CUDA_PROVIDER_LIBRARY = "libonnxruntime_providers_cuda.so"
_CUDART = "libcudart.so"
_DT_NEEDED, _DT_STRTAB, _PT_LOAD, _PT_DYNAMIC = 1, 5, 1, 2


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
    """The CUDA runtime ONNX Runtime uses, or None where none loads (loaded once per process).

    One process, one CUDA runtime: a second one (a machine's CUDA 13 `libcudart.so` beside
    the CUDA 12 runtime onnxruntime-gpu maps) would hold a context and allocations of its own.
    Tried as `cudart_candidates` lists; cudaGetDevice, cudaSetDevice and cudaMemGetInfo are
    declared. Device buffers use it for their allocations and partial copies.
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
        logger.debug("CUDA runtime: %s", candidate)
        return library
    logger.debug("no CUDA runtime found; device memory readings are unavailable")
    return None


def cudart_candidates() -> list[str]:
    """What `cudart` tries to load, in order (`choose_cudart` over this process's maps, the
    soname ONNX Runtime's CUDA provider needs and the nvidia-* wheels' copies)."""
    needed = ort_cudart_soname()
    return choose_cudart(mapped_cudart(), needed, _wheel_cudart_paths(needed))


def choose_cudart(mapped: list[str], needed: str | None, wheel_copies: list[str]) -> list[str]:
    """The CUDA runtimes to try, in order:

    1. the libcudart this process maps with the soname ONNX Runtime's CUDA provider needs
       (mapped once the provider is loaded: the very library it uses);
    2. that soname, through the loader (which returns the mapped one if it is mapped), then the
       nvidia-* wheels' copies of it (the loader does not search their folders by itself);
    3. without a CUDA provider library (a CPU wheel), a libcudart the process maps already.
    Never a libcudart of another soname than the provider's: that would be a second runtime.
    """
    if needed is None:
        return [path for path in mapped if Path(path).name.startswith(_CUDART)][:1]
    # /proc/self/maps names the file the soname's link resolves to (libcudart.so.13.0.96).
    same = [path for path in mapped if Path(path).name == needed
            or Path(path).name.startswith(f"{needed}.")]
    copies = [path for path in wheel_copies if Path(path).name == needed]
    return [*same[:1], needed, *copies]


def mapped_cudart() -> list[str]:
    """The libcudart files this process maps now (/proc/self/maps; empty without /proc)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found: list[str] = []
    for line in maps.splitlines():
        fields = line.split(None, 5)
        path = fields[5].strip() if len(fields) == 6 else ""
        if Path(path).name.startswith(_CUDART) and path not in found:
            found.append(path)
    return found


@functools.lru_cache(maxsize=1)
def ort_cudart_soname() -> str | None:
    """The libcudart soname ONNX Runtime's CUDA provider library needs (its ELF DT_NEEDED),
    or None without that library (a CPU wheel) or a readable one."""
    try:
        import onnxruntime
    except ImportError:
        return None
    library = Path(onnxruntime.__file__).parent / "capi" / CUDA_PROVIDER_LIBRARY
    try:
        needed = elf_needed(library)
    except (OSError, ValueError):
        return None
    return next((name for name in needed if name.startswith(_CUDART)), None)


def elf_needed(path: Path) -> list[str]:
    """The DT_NEEDED entries of a little-endian ELF64 shared library (ValueError otherwise)."""
    with path.open("rb") as handle:
        header = handle.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            raise ValueError(f"{path} is not a little-endian ELF64 file")
        phoff = int.from_bytes(header[0x20:0x28], "little")
        entry_size = int.from_bytes(header[0x36:0x38], "little")
        count = int.from_bytes(header[0x38:0x3A], "little")
        handle.seek(phoff)
        table = handle.read(entry_size * count)
        loads, dynamic = [], None
        for index in range(count):
            entry = table[index * entry_size:(index + 1) * entry_size]
            kind = int.from_bytes(entry[0:4], "little")
            offset, vaddr = (int.from_bytes(entry[8:16], "little"),
                             int.from_bytes(entry[16:24], "little"))
            size = int.from_bytes(entry[32:40], "little")
            if kind == _PT_LOAD:
                loads.append((vaddr, offset, size))
            elif kind == _PT_DYNAMIC:
                dynamic = (offset, size)
        if dynamic is None:
            return []
        handle.seek(dynamic[0])
        raw = handle.read(dynamic[1])
        tags = [(int.from_bytes(raw[i:i + 8], "little"), int.from_bytes(raw[i + 8:i + 16],
                                                                         "little"))
                for i in range(0, len(raw) - 15, 16)]
        strtab = next((value for tag, value in tags if tag == _DT_STRTAB), None)
        start = next((offset + strtab - vaddr for vaddr, offset, size in loads
                      if strtab is not None and vaddr <= strtab < vaddr + size), None)
        if start is None:
            raise ValueError(f"{path} has no string table in a loaded segment")
        names = []
        for tag, value in tags:
            if tag == _DT_NEEDED:
                handle.seek(start + value)
                names.append(handle.read(256).split(b"\0", 1)[0].decode())
        return names


def _declare_cudart(library: ctypes.CDLL) -> None:
    library.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
    library.cudaSetDevice.argtypes = [ctypes.c_int]
    library.cudaMemGetInfo.argtypes = [ctypes.POINTER(ctypes.c_size_t),
                                       ctypes.POINTER(ctypes.c_size_t)]
    for function in (library.cudaGetDevice, library.cudaSetDevice, library.cudaMemGetInfo):
        function.restype = ctypes.c_int


def _wheel_cudart_paths(needed: str | None) -> list[str]:
    if needed is None:
        return []
    found: list[str] = []
    for entry in sys.path:
        nvidia = Path(entry) / "nvidia"
        if nvidia.is_dir():
            found.extend(str(path) for path in sorted(nvidia.glob(f"*/lib/{needed}")))
    return found
