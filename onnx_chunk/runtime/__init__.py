"""The onnx-chunk runtime: chunked prefill with KV at capacity on ONNX Runtime.

Its parts, one folder each: `runner/` (the model runner: every forward of a dynamic decoder),
`engine/` (requests, the scheduler, slots, lone sequences), `caches/` (the variant cache, the
sessions and CUDA graphs hung off it) and `device/` (the provider, buffers, memory, sessions);
`model.py` wires them into a `Runtime`.
"""

from __future__ import annotations

from onnx_chunk.runtime.device.provider import PROVIDER_CHOICES, Device, MaskPolicy, resolve_device
from onnx_chunk.runtime.engine.batch_engine import StepResult
from onnx_chunk.runtime.engine.request import Request, RequestStats
from onnx_chunk.runtime.engine.sequence import Sequence
from onnx_chunk.runtime.model import Runtime, load
from onnx_chunk.runtime.options import RuntimeOptions
from onnx_chunk.runtime.stats import (
    ChunkRecord,
    EngineStats,
    GenerationStats,
    RuntimeStats,
    SequenceStats,
)

__all__ = ["PROVIDER_CHOICES", "ChunkRecord", "Device", "EngineStats", "GenerationStats",
           "MaskPolicy", "Request", "RequestStats", "Runtime", "RuntimeOptions", "RuntimeStats",
           "Sequence", "SequenceStats", "StepResult", "load", "resolve_device"]
