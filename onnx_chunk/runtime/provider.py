"""The old import path of `onnx_chunk.runtime.device.provider`, kept while onnx_chunk.static
still imports it from here (issue 22: it moves with the static runner's own change)."""

from onnx_chunk.runtime.device.provider import Device, resolve_device

__all__ = ["Device", "resolve_device"]
