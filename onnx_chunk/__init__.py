"""onnx-chunk: chunked prefill, query-axis ladder padding and a bounded variant cache for ONNX decoders."""

__version__ = "0.1.0"
