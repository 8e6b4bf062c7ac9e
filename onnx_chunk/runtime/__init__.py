"""The onnx-chunk runtime: chunked prefill with KV at capacity on ONNX Runtime."""

from __future__ import annotations

from onnx_chunk.runtime.model import Runtime, load
from onnx_chunk.runtime.device.provider import Device, MaskPolicy, resolve_device
from onnx_chunk.runtime.engine.request import Request, RequestStats
from onnx_chunk.runtime.engine.sequence import Sequence
from onnx_chunk.runtime.stats import (ChunkRecord, EngineStats, GenerationStats, RuntimeStats,
                                      SequenceStats)

__all__ = ["ChunkRecord", "Device", "EngineStats", "GenerationStats", "MaskPolicy", "Request",
           "RequestStats", "Runtime", "RuntimeStats", "Sequence", "SequenceStats", "load",
           "resolve_device"]
