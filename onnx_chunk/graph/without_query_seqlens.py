"""A decoder converted for native chunks, made loadable by an ONNX Runtime without them.

`onnx-chunk convert` wires GroupQueryAttention's `query_seqlens` where the ONNX Runtime it runs
under has the input (the 1.32 CPU wheel). An ONNX Runtime without it (onnxruntime-gpu 1.31)
refuses such a graph: its GroupQueryAttention schema takes fewer inputs. So a folder converted
on one machine is served on another: the runtime loads it with `without_query_seqlens`'s graph
and runs the "repeat" path, as for a folder converted there.

Rules (an edit of the serialized model through `graph_edit`, as `logits_row.select_row`: the
device path imports no onnx or onnx_ir; every field not named here keeps its bytes):
1. Every GroupQueryAttention of the main graph, and of the branches of its If nodes (where
   `passes.kv_prefill` puts the nodes of a quantized cache), drops the input the pass feeds it
   (`query_seqlens.QUERY_SEQLENS_FED`), then its trailing empty inputs (omitted optional
   inputs, as the exporter's): the node takes what it took as exported. Other readers of that
   value (the float branch's row count) then read every row of the chunk.
2. The graph input `query_seqlens` is dropped (its initializer stays, read by the pass's few
   nodes, which now feed nothing), and so is the metadata key that names it: the edited model
   reads as one converted without native chunks.
3. A model whose GroupQueryAttention nodes take no such input is refused (ModelStructureError):
   its metadata and graph disagree.
"""

from __future__ import annotations

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.graph.graph_edit import edit_decoder
from onnx_chunk.graph.metadata import QUERY_SEQLENS_KEY
from onnx_chunk.graph.onnx_wire import (
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
from onnx_chunk.graph.query_seqlens import QUERY_SEQLENS, QUERY_SEQLENS_FED

# onnx.proto field numbers read here.
_MODEL_METADATA = 14
_ENTRY_KEY = 1
_GRAPH_NODE, _GRAPH_INPUT = 1, 11
_NODE_INPUT, _NODE_OP_TYPE, _NODE_ATTRIBUTE = 1, 4, 5
_ATTRIBUTE_GRAPH = 6
_VALUE_NAME = 1
_GQA = "GroupQueryAttention"
_IF = "If"


def without_query_seqlens(model: bytes) -> bytes:
    """The serialized `model` with its query_seqlens wiring taken out (the rules above)."""
    def naming_the_input(number: int, value: int | Span) -> bool:
        return number == _MODEL_METADATA and \
            string_field(model, as_span(value), _ENTRY_KEY) == QUERY_SEQLENS_KEY

    return edit_decoder(model, lambda view, span: _graph(model, view, span), naming_the_input)


def _graph(data: bytes, view: memoryview, span: Span) -> list:
    out, unwired = _pieces(data, view, span)
    if not unwired:
        raise ModelStructureError(
            f"the model's metadata names a {QUERY_SEQLENS!r} input (native chunks), but no "
            f"GroupQueryAttention takes {QUERY_SEQLENS_FED!r}; convert the original export "
            "again")
    return out


def _pieces(data: bytes, view: memoryview, span: Span) -> tuple[list, int]:
    """The GraphProto at `span` as pieces, with rules 1 and 2 applied, and how many
    GroupQueryAttention nodes (its If branches' included) dropped the input."""
    out: list = []
    unwired = 0
    for number, wire, value in fields(data, *span):
        field = as_span(value) if wire == LEN else None
        if field is not None and number == _GRAPH_INPUT and \
                string_field(data, field, _VALUE_NAME) == QUERY_SEQLENS:
            continue
        if field is not None and number == _GRAPH_NODE:
            op_type = string_field(data, field, _NODE_OP_TYPE)
            if op_type == _GQA:
                node, dropped = _node(data, field)
                if dropped:
                    unwired += 1
                    out.append(encode_len_field(_GRAPH_NODE, node))
                    continue
            elif op_type == _IF:
                node, count = _branches(data, view, field)
                if count:
                    unwired += count
                    out.append(encode_len_field(_GRAPH_NODE, node))
                    continue
        out += field_pieces(view, number, wire, value)
    return out, unwired


def _branches(data: bytes, view: memoryview, span: Span) -> tuple[bytes, int]:
    """The If NodeProto at `span` with rule 1 applied in its branches (graph attributes), and
    how many GroupQueryAttention nodes there dropped the input."""
    out: list = []
    unwired = 0
    for number, wire, value in fields(data, *span):
        if number != _NODE_ATTRIBUTE or wire != LEN:
            out += field_pieces(view, number, wire, value)
            continue
        attribute: list = []
        for inner, inner_wire, inner_value in fields(data, *as_span(value)):
            if inner == _ATTRIBUTE_GRAPH and inner_wire == LEN:
                graph, count = _pieces(data, view, as_span(inner_value))
                unwired += count
                attribute.append(encode_len_field(inner, b"".join(graph)))
            else:
                attribute += field_pieces(view, inner, inner_wire, inner_value)
        out.append(encode_len_field(number, b"".join(attribute)))
    return b"".join(out), unwired


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
