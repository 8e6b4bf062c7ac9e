"""The static-graph system: serving decoders whose every dimension is fixed (accelerators that
run fixed shapes only).

A pair of graphs with one KV capacity C, a chunk graph (rows c) and a decode graph (rows 1), is
detected by structure and opened (`model`), a prompt is aligned to whole chunks (`alignment`), the
chunks and then the decode rows run (`runner`) on one of two caches: a rolling, right-aligned one
with a per-chunk additive mask (`rolling_kv`, `mask`) or GroupQueryAttention's bound at capacity
(`bound_kv`), both over the same fixed buffers (`kv_buffers`). `fix_shapes` writes such a pair
from a dynamic decoder. What it shares with the dynamic runtime: the provider choice and device
buffers, the token choice (`onnx_chunk.sampling.Sampler`) and the finish rule
(`runtime.engine.request.finish_reason`).
"""

from __future__ import annotations

from onnx_chunk.static.alignment import StaticLimits, suggest_capacity
from onnx_chunk.static.loading import is_static_model, load_static
from onnx_chunk.static.runner import StaticGenerationResult, StaticRunner

__all__ = ["StaticGenerationResult", "StaticLimits", "StaticRunner", "is_static_model",
           "load_static", "suggest_capacity"]
