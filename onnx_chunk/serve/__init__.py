"""An OpenAI-compatible server on the batch engine: `create_app(runtime)` (needs the `serve`
extra: starlette, uvicorn, prometheus-client); `onnx-chunk serve` runs it."""

from __future__ import annotations

from onnx_chunk.serve.app import create_app

__all__ = ["create_app"]
