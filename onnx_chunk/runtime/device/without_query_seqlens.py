"""A decoder converted for native chunks, made loadable by an ONNX Runtime without them.

`onnx-chunk convert` wires GroupQueryAttention's `query_seqlens` where the ONNX Runtime it runs
under has the input (the 1.32 CPU wheel). An ONNX Runtime without it (onnxruntime-gpu 1.31)
refuses such a graph: its GroupQueryAttention schema takes fewer inputs. So a folder converted
on one machine is served on another: the runtime loads it with `without_query_seqlens`'s graph
and runs the "repeat" path, as for a folder converted there.

Rules (an edit of the serialized model through `graph_edit`, as `logits_row.select_row`: the
device path imports no onnx or onnx_ir; every field not named here keeps its bytes):
1. Every GroupQueryAttention of the main graph drops the input the pass feeds it
   (`query_seqlens.QUERY_SEQLENS_FED`), then its trailing empty inputs (omitted optional
   inputs, as the exporter's): the node takes what it took as exported.
2. The graph input `query_seqlens` is dropped (its initializer stays, read by the pass's few
   nodes, which now feed nothing), and so is the metadata key that names it: the edited model
   reads as one converted without native chunks.
3. A model whose GroupQueryAttention nodes take no such input is refused (ModelStructureError):
   its metadata and graph disagree.
"""

from __future__ import annotations

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.metadata import QUERY_SEQLENS_KEY
from onnx_chunk.onnx_wire import (
    LEN,
    Span,
    as_span,
    encode_len_field,
    field_bytes,
    field_pieces,
    fields,
    string_field,
    text,
)
from onnx_chunk.query_seqlens import QUERY_SEQLENS, QUERY_SEQLENS_FED
from onnx_chunk.runtime.device.graph_edit import edit_decoder

# onnx.proto field numbers read here.
_MODEL_METADATA = 14
_ENTRY_KEY = 1
_GRAPH_NODE, _GRAPH_INPUT = 1, 11
_NODE_INPUT, _NODE_OP_TYPE = 1, 4
_VALUE_NAME = 1
_GQA = "GroupQueryAttention"


def without_query_seqlens(model: bytes) -> bytes:
    """The serialized `model` with its query_seqlens wiring taken out (the rules above)."""
    def naming_the_input(number: int, value: int | Span) -> bool:
        return number == _MODEL_METADATA and \
            string_field(model, as_span(value), _ENTRY_KEY) == QUERY_SEQLENS_KEY

    return edit_decoder(model, lambda view, span: _graph(model, view, span), naming_the_input)


def _graph(data: bytes, view: memoryview, span: Span) -> list:
    out: list = []
    unwired = 0
    for number, wire, value in fields(data, *span):
        field = as_span(value) if wire == LEN else None
        if field is not None and number == _GRAPH_INPUT and \
                string_field(data, field, _VALUE_NAME) == QUERY_SEQLENS:
            continue
        if field is not None and number == _GRAPH_NODE and \
                string_field(data, field, _NODE_OP_TYPE) == _GQA:
            node, dropped = _node(data, field)
            if dropped:
                unwired += 1
                out.append(encode_len_field(_GRAPH_NODE, node))
                continue
        out += field_pieces(view, number, wire, value)
    if not unwired:
        raise ModelStructureError(
            f"the model's metadata names a {QUERY_SEQLENS!r} input (native chunks), but no "
            f"GroupQueryAttention takes {QUERY_SEQLENS_FED!r}; convert the original export "
            "again")
    return out


def _node(data: bytes, span: Span) -> tuple[bytes, bool]:
    """The NodeProto at `span` without the fed query_seqlens input (rule 1), and whether it
    had one. The inputs go where the first one was."""
    inputs: list[str] = []
    rest: list[bytes] = []
    first: int | None = None
    for number, wire, value in fields(data, *span):
        if number == _NODE_INPUT and wire == LEN:
            if first is None:
                first = len(rest)
            inputs.append(text(data, as_span(value)))
        else:
            rest.append(field_bytes(data, number, wire, value))
    if QUERY_SEQLENS_FED not in inputs:
        return b"", False
    kept = ["" if name == QUERY_SEQLENS_FED else name for name in inputs]
    while kept and not kept[-1]:
        kept.pop()
    encoded = b"".join(encode_len_field(_NODE_INPUT, name) for name in kept)
    at = first if first is not None else 0
    return b"".join([*rest[:at], encoded, *rest[at:]]), True
