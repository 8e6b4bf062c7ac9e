"""The onnx-chunk runtime: chunked prefill with KV at capacity on ONNX Runtime."""

from __future__ import annotations

from onnx_chunk.runtime.engine import Runtime, load
from onnx_chunk.runtime.provider import Device, MaskPolicy, resolve_device
from onnx_chunk.runtime.request import Request, RequestStats
from onnx_chunk.runtime.sequence import Sequence
from onnx_chunk.runtime.stats import (ChunkRecord, EngineStats, GenerationStats, RuntimeStats,
                                      SequenceStats)

__all__ = ["ChunkRecord", "Device", "EngineStats", "GenerationStats", "MaskPolicy", "Request",
           "RequestStats", "Runtime", "RuntimeStats", "Sequence", "SequenceStats", "load",
           "resolve_device"]
