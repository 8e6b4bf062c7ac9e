"""The onnx-chunk runtime: chunked prefill with KV at capacity on ONNX Runtime.

Its parts, one folder each, in layers that import only downwards (state <- device <- caches <-
runner <- engine <- facade; tests/runtime/test_layers.py): `state/` (the decoder's ports),
`device/` (the provider, buffers, memory, sessions), `caches/` (the variant cache, the sessions
and CUDA graphs hung off it), `runner/` (the model runner: every forward of a dynamic decoder)
and `engine/` (requests, the scheduler and its plan runner, slots, lone sequences, their
counters); `facade.py` wires them into a `Runtime`, with `loading.py` (what it reads of the
decoder first), `options.py` and `stats.py` beside it.
"""

from __future__ import annotations

from onnx_chunk.runtime.device.provider import PROVIDER_CHOICES, Device, MaskPolicy, resolve_device
from onnx_chunk.runtime.engine.counters import (
    ChunkRecord,
    EngineStats,
    GenerationStats,
    SequenceStats,
)
from onnx_chunk.runtime.engine.plan import StepResult
from onnx_chunk.runtime.engine.request import Request, RequestStats
from onnx_chunk.runtime.engine.sequence import Sequence
from onnx_chunk.runtime.facade import Runtime, load
from onnx_chunk.runtime.options import RuntimeOptions
from onnx_chunk.runtime.stats import RuntimeStats

__all__ = ["PROVIDER_CHOICES", "ChunkRecord", "Device", "EngineStats", "GenerationStats",
           "MaskPolicy", "Request", "RequestStats", "Runtime", "RuntimeOptions", "RuntimeStats",
           "Sequence", "SequenceStats", "StepResult", "load", "resolve_device"]
