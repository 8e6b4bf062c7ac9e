"""onnx-chunk: chunked prefill, query-axis ladder padding and a bounded variant cache for ONNX
decoders."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The one place the version is written: pyproject.toml reads it from here.
__version__ = "0.1.0"

# The public API, name -> the module that exports it, re-exported lazily so that
# `import onnx_chunk` (and `onnx-chunk --help`) does not pay for importing ONNX Runtime.
# The server's `create_app` stays in `onnx_chunk.serve` (it needs the `serve` extra).
_API = {
    **dict.fromkeys(("GenerationStats", "Request", "RequestStats", "Runtime", "RuntimeOptions",
                     "RuntimeStats", "Sequence", "SequenceStats", "load"), "onnx_chunk.runtime"),
    **dict.fromkeys(("StaticLimits", "StaticRunner", "load_static", "suggest_capacity"),
                    "onnx_chunk.static"),
    **dict.fromkeys(("Completion", "generate_text", "stream_text"), "onnx_chunk.text.generation"),
    "tokenizer_of": "onnx_chunk.text.tokenizer",
    "Conversation": "onnx_chunk.text.conversation",
    "Sampling": "onnx_chunk.sampling",
}

__all__ = [
    "Completion", "Conversation", "GenerationStats", "Request", "RequestStats", "Runtime",
    "RuntimeOptions", "RuntimeStats", "Sampling", "Sequence", "SequenceStats", "StaticLimits",
    "StaticRunner", "__version__", "generate_text", "load", "load_static", "stream_text",
    "suggest_capacity", "tokenizer_of",
]

if TYPE_CHECKING:
    from onnx_chunk.runtime import (
        GenerationStats,
        Request,
        RequestStats,
        Runtime,
        RuntimeOptions,
        RuntimeStats,
        Sequence,
        SequenceStats,
        load,
    )
    from onnx_chunk.sampling import Sampling
    from onnx_chunk.static import StaticLimits, StaticRunner, load_static, suggest_capacity
    from onnx_chunk.text.conversation import Conversation
    from onnx_chunk.text.generation import Completion, generate_text, stream_text
    from onnx_chunk.text.tokenizer import tokenizer_of


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'onnx_chunk' has no attribute {name!r}")
    from onnx_chunk._onnxruntime_wheels import check_one_wheel

    check_one_wheel()
    return getattr(importlib.import_module(module), name)
