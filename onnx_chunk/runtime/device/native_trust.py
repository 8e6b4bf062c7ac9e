"""Whether a device's GroupQueryAttention is trusted with `query_seqlens` (native chunks).

A converted folder's native chunks right-pad a chunk and tell GroupQueryAttention how many of
its rows are real; the kernel must append only those to the cache. ONNX Runtime's schema says
so for every provider (the runtime reads it: `query_seqlens.query_seqlens_index`), but a schema
is not a kernel: a CUDA kernel that ignored the input would write the padded rows into the KV
cache, and no error would say so. Rules:

1. On the CPU provider native chunks run where the schema has the input: the 1.32 CPU wheel's
   kernel was measured (a padded 5-of-8 chunk gave exactly the unpadded call's outputs and
   cache).
2. On any other device they run only where this ONNX Runtime build was checked on that device
   (padded = unpadded outputs and cache, on the device): `scripts/gpu_first_run.sh` makes the
   check and, when it passes, records it (`record_verified`) under the build's key
   (`build_key`: the version and the size of its CUDA provider library) in the cache folder
   ($ONNX_CHUNK_CACHE, else ~/.cache/onnx-chunk). Elsewhere the folder runs without them (the
   "repeat" path of a folder converted there), and the load says why.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import onnxruntime as ort

from onnx_chunk.runtime.device.memory import CUDA_PROVIDER_LIBRARY
from onnx_chunk.runtime.device.provider import Device

_FOLDER = "native-chunks"


def cache_folder() -> Path:
    """Where verified builds are recorded ($ONNX_CHUNK_CACHE, else ~/.cache/onnx-chunk)."""
    root = os.environ.get("ONNX_CHUNK_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "onnx-chunk") / _FOLDER


def build_key(device: Device) -> str:
    """The installed ONNX Runtime build, as its checks are recorded: the version, the device
    type, and the size of the CUDA provider library where there is one."""
    library = Path(ort.__file__).parent / "capi" / CUDA_PROVIDER_LIBRARY
    size = library.stat().st_size if library.is_file() else 0
    digest = hashlib.sha256(f"{ort.__version__}:{device.device_type}:{size}".encode())
    return f"{device.device_type}-{ort.__version__}-{digest.hexdigest()[:12]}"


def native_refusal(device: Device) -> str | None:
    """None where native chunks run on `device` (the rules above), else why not."""
    if device.device_type == "cpu":
        return None
    if (cache_folder() / f"{build_key(device)}.json").is_file():
        return None
    return (f"GroupQueryAttention's query_seqlens is not verified on {device.label} under "
            f"onnxruntime {ort.__version__} (scripts/gpu_first_run.sh checks it and records "
            f"the result in {cache_folder()})")


def record_verified(device: Device, detail: str) -> Path:
    """Record that native chunks were checked on `device` under this build (the GPU check's
    native row, after padded = unpadded held on the device); the record's path."""
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{build_key(device)}.json"
    path.write_text(json.dumps({"onnxruntime": ort.__version__, "device": device.label,
                                "detail": detail}) + "\n")
    return path
