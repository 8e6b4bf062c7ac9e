"""`onnx-chunk validate`: checks that a decoder is safe for chunked prefill, for CI gates."""

from onnx_chunk.validate.checks import CHECKS, resolve_skip
from onnx_chunk.validate.report import CheckResult, Outcome, Report
from onnx_chunk.validate.validator import Progress, ValidationOptions, validate_model

__all__ = [
    "CHECKS",
    "CheckResult",
    "Outcome",
    "Progress",
    "Report",
    "ValidationOptions",
    "resolve_skip",
    "validate_model",
]
