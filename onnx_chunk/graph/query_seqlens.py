"""Whether the installed ONNX Runtime's GroupQueryAttention takes `query_seqlens`.

ONNX Runtime 1.32 gives `com.microsoft::GroupQueryAttention` an optional input `query_seqlens`
([batch] int32): a chunk right-padded to a query length S whose first Q rows per batch entry
are real. Only the real rows enter the cache, positions and the causal/local window follow them,
padded output rows are unspecified, and Q = 0 leaves an entry's cache untouched (the operator's
schema text, "Right-padded query chunks"). The passes wire it (`passes.query_seqlens`) and the
runtime feeds it; both ask this module, which reads the installed ONNX Runtime's own schema
(no version string) and imports neither onnx nor onnx_ir, so a runtime load stays lean;
ONNX Runtime itself is imported only when asked, so the offline passes run without it (and,
without it, wire nothing).
"""

from __future__ import annotations

import functools

QUERY_SEQLENS = "query_seqlens"
# What every GroupQueryAttention of a converted model reads as query_seqlens: the graph input,
# or every row of the chunk when it is left out (passes.query_seqlens, rule 5).
QUERY_SEQLENS_FED = f"{QUERY_SEQLENS}_or_all_rows"
_GQA = ("GroupQueryAttention", "com.microsoft")


@functools.lru_cache(maxsize=1)
def query_seqlens_index() -> int | None:
    """The position of `query_seqlens` among GroupQueryAttention's inputs in the installed
    ONNX Runtime's schema, or None when that ONNX Runtime lacks it (or none is installed)."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_c
    except ImportError:
        return None
    for schema in ort_c.get_all_operator_schema():
        if (schema.name, schema.domain) != _GQA:
            continue
        for index, parameter in enumerate(schema.inputs):
            if parameter.name == QUERY_SEQLENS:
                return index
    return None


def lacking_reason() -> str:
    """Why native chunks cannot run here (for errors), naming the installed version."""
    try:
        import onnxruntime
    except ImportError:
        return "no ONNX Runtime is installed to run GroupQueryAttention's query_seqlens"
    return (f"the installed ONNX Runtime ({onnxruntime.__version__}) has no GroupQueryAttention "
            f"input {QUERY_SEQLENS!r} (ONNX Runtime 1.32's CPU wheel has it)")
