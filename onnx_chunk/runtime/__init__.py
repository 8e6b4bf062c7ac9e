"""The onnx-chunk runtime: chunked prefill with KV at capacity on ONNX Runtime.

Names are imported lazily, so that pure modules of this package (the ladder, the padding plan)
can be imported by the offline passes without importing ONNX Runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it.
_API = {
    "ChunkRecord": "stats",
    "Device": "provider",
    "EngineStats": "stats",
    "GenerationStats": "stats",
    "MaskPolicy": "provider",
    "Request": "request",
    "RequestStats": "request",
    "Runtime": "engine",
    "RuntimeStats": "stats",
    "Sequence": "sequence",
    "SequenceStats": "stats",
    "load": "engine",
    "resolve_device": "provider",
}

__all__ = sorted(_API)

if TYPE_CHECKING:
    from onnx_chunk.runtime.engine import Runtime, load
    from onnx_chunk.runtime.provider import Device, MaskPolicy, resolve_device
    from onnx_chunk.runtime.request import Request, RequestStats
    from onnx_chunk.runtime.sequence import Sequence
    from onnx_chunk.runtime.stats import (ChunkRecord, EngineStats, GenerationStats,
                                          RuntimeStats, SequenceStats)


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'onnx_chunk.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"onnx_chunk.runtime.{module}"), name)
