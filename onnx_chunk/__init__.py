"""onnx-chunk: chunked prefill, query-axis ladder padding and a bounded variant cache for ONNX decoders."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The public API, name -> the module that exports it, re-exported lazily so that
# `import onnx_chunk` (and `onnx-chunk --help`) does not pay for importing ONNX Runtime.
_API = {
    **dict.fromkeys(("GenerationStats", "Runtime", "RuntimeStats", "Sequence", "SequenceStats",
                     "load"), "onnx_chunk.runtime"),
    **dict.fromkeys(("StaticLimits", "StaticRunner", "load_static", "suggest_capacity"),
                    "onnx_chunk.static"),
    "Sampling": "onnx_chunk.sampling",
}

__all__ = [*_API, "__version__"]

if TYPE_CHECKING:
    from onnx_chunk.runtime import (GenerationStats, Runtime, RuntimeStats, Sequence,
                                    SequenceStats, load)
    from onnx_chunk.sampling import Sampling
    from onnx_chunk.static import StaticLimits, StaticRunner, load_static, suggest_capacity


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'onnx_chunk' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
