"""onnx-chunk: chunked prefill, query-axis ladder padding and a bounded variant cache for ONNX decoders."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The runtime API, re-exported lazily so that `import onnx_chunk` (and `onnx-chunk --help`)
# does not pay for importing ONNX Runtime.
_RUNTIME_API = ("GenerationStats", "Runtime", "RuntimeStats", "Sequence", "SequenceStats",
                "StaticLimits", "StaticRunner", "load", "load_static", "suggest_capacity")

# Pure modules of the package root, re-exported the same way.
_ROOT_API = {"Sampling": "onnx_chunk.sampling"}

__all__ = [*_RUNTIME_API, *_ROOT_API, "__version__"]

if TYPE_CHECKING:
    from onnx_chunk.runtime import (GenerationStats, Runtime, RuntimeStats, Sequence,
                                    SequenceStats, StaticLimits, StaticRunner, load,
                                    load_static, suggest_capacity)
    from onnx_chunk.sampling import Sampling


def __getattr__(name: str) -> Any:
    if name in _RUNTIME_API:
        return getattr(importlib.import_module("onnx_chunk.runtime"), name)
    if name in _ROOT_API:
        return getattr(importlib.import_module(_ROOT_API[name]), name)
    raise AttributeError(f"module 'onnx_chunk' has no attribute {name!r}")
