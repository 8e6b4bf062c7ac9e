"""Refuse graphs whose opsets or operator domains ONNX Runtime would not run."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from onnx_chunk.errors import ModelStructureError

# The oldest default-domain opset ONNX Runtime still loads; the newest is the one this onnx
# package defines.
MIN_DEFAULT_OPSET = 7
MAX_DEFAULT_OPSET = onnx.defs.onnx_opset_version()
# Domains ONNX Runtime implements, with the opset versions it accepts (None: any).
_KNOWN_DOMAINS: dict[str, range | None] = {
    "": range(MIN_DEFAULT_OPSET, MAX_DEFAULT_OPSET + 1),
    "ai.onnx": range(MIN_DEFAULT_OPSET, MAX_DEFAULT_OPSET + 1),
    "com.microsoft": range(1, 2),
    "ai.onnx.ml": None,
    "com.microsoft.nchwc": None,
}


def check_supported_opsets(model: ir.Model) -> None:
    """Raise ModelStructureError when an opset import or a node domain is one ORT cannot run.

    Rules:
    1. Default-domain opsets run from 7 to the newest this onnx package defines;
       `com.microsoft` must be version 1.
    2. Every node's domain is one ONNX Runtime implements or one of the model's own functions.
    """
    for domain, version in model.opset_imports.items():
        accepted = _KNOWN_DOMAINS.get(domain)
        if accepted is not None and version not in accepted:
            raise ModelStructureError(
                f"the model imports opset {version} of domain {domain or 'ai.onnx'!r}; "
                f"onnx-chunk supports versions {accepted.start} to {accepted.stop - 1}: "
                "re-export the model with a supported opset"
            )
    function_domains = {domain for domain, _, _ in model.functions}
    unknown = sorted({node.domain for node in ir.traversal.RecursiveGraphIterator(model.graph)
                      if node.domain not in _KNOWN_DOMAINS
                      and node.domain not in function_domains})
    if unknown:
        raise ModelStructureError(
            f"the graph uses operator domain(s) {', '.join(map(repr, unknown))}, which ONNX "
            "Runtime does not implement; expected standard ONNX and com.microsoft operators"
        )
