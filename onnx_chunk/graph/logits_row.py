"""A session that returns one logits row, picked by an input: what a captured width outputs.

A CUDA graph replays fixed addresses, so a width that captures keeps its output buffers bound
for good, per sequence: [1, W, vocab] logits for a prefill width (16 MiB at W = 256 and a 32k
vocabulary in float16, per sequence and per width), though a prefill needs one row at most,
the last real one (padded rows repeat the last token, so its index moves with the padding).
The session built for such a width takes the row to return as an input, written in place
before each forward like the tokens, so the bound logits are [1, 1, vocab]; the full logits
become an intermediate of the session's own arena, shared by every sequence. When a caller
asks for every row, the same session runs with the full output bound instead (`ALL_ROWS`).

Rules of `select_row` (an edit of the serialized model through `graph_edit`, so that the device
path imports no onnx or onnx_ir; every field it does not name keeps its bytes):
1. A graph input `logits_row` ([1] int64) is added and `logits` becomes `Gather(rows,
   logits_row, axis=1)`: [batch, 1, vocab], the first output.
2. The full logits stay a graph output, renamed `logits_all` (in the main graph's nodes, its
   outputs and value_info), for the callers that need every row.
3. A model whose logits keep one row already (a fixed 1 on the row axis) gets nothing: it is
   refused, since its only row is the last query row, not a chosen one.
"""

from __future__ import annotations

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.graph.graph_edit import edit_decoder
from onnx_chunk.graph.model_file import read_value_info
from onnx_chunk.graph.onnx_wire import (
    LEN,
    Span,
    as_span,
    encode_len_field,
    encode_varint_field,
    field_bytes,
    field_pieces,
    fields,
    string_field,
    text,
)

ROW_INPUT = "logits_row"
ALL_ROWS = "logits_all"

# onnx.proto field numbers written here.
_GRAPH_NODE, _GRAPH_INPUT, _GRAPH_OUTPUT, _GRAPH_VALUE_INFO = 1, 11, 12, 13
_NODE_INPUT, _NODE_OUTPUT, _NODE_NAME, _NODE_OP_TYPE, _NODE_ATTRIBUTE = 1, 2, 3, 4, 5
_ATTR_NAME, _ATTR_I, _ATTR_TYPE, _ATTR_TYPE_INT = 1, 3, 20, 2
_VALUE_NAME, _VALUE_TYPE = 1, 2
_TYPE_TENSOR, _TENSOR_ELEM, _TENSOR_SHAPE, _SHAPE_DIM, _DIM_VALUE = 1, 1, 2, 1, 1
_INT64 = 7

# The decoder's logits output, as every export names it.
LOGITS_OUTPUT = "logits"


def select_row(model: bytes) -> bytes:
    """The serialized `model` whose `logits` output is the row its `logits_row` input picks."""
    return edit_decoder(model, lambda view, span: _graph(model, view, span))


def _graph(data: bytes, view: memoryview, span: Span) -> list:
    """The pieces of the graph at `span`, rewritten."""
    out: list = []
    found = False
    for number, wire, value in fields(data, *span):
        field = as_span(value) if wire == LEN else None
        if field is not None and number == _GRAPH_OUTPUT and \
                string_field(data, field, _VALUE_NAME) == LOGITS_OUTPUT:
            found = True
            out.append(encode_len_field(_GRAPH_OUTPUT, _picked_output(data, field)))
            out.append(encode_len_field(_GRAPH_OUTPUT, _renamed(data, field, (_VALUE_NAME,))))
        elif field is not None and number == _GRAPH_VALUE_INFO and \
                string_field(data, field, _VALUE_NAME) == LOGITS_OUTPUT:
            out.append(encode_len_field(number, _renamed(data, field, (_VALUE_NAME,))))
        elif field is not None and number == _GRAPH_NODE and \
                data.find(LOGITS_OUTPUT.encode(), *field) != -1:
            out.append(encode_len_field(number,
                                        _renamed(data, field, (_NODE_INPUT, _NODE_OUTPUT))))
        else:
            out += field_pieces(view, number, wire, value)
    if not found:
        raise ModelStructureError(f"the decoder has no {LOGITS_OUTPUT!r} output to pick a row of")
    row_shape = encode_len_field(_SHAPE_DIM, encode_varint_field(_DIM_VALUE, 1))
    out.append(encode_len_field(_GRAPH_INPUT, _value_info(ROW_INPUT, _INT64, row_shape)))
    axis = (encode_len_field(_ATTR_NAME, "axis") + encode_varint_field(_ATTR_I, 1)
            + encode_varint_field(_ATTR_TYPE, _ATTR_TYPE_INT))
    gather = (encode_len_field(_NODE_INPUT, ALL_ROWS) + encode_len_field(_NODE_INPUT, ROW_INPUT)
              + encode_len_field(_NODE_OUTPUT, LOGITS_OUTPUT)
              + encode_len_field(_NODE_NAME, "select_logits_row")
              + encode_len_field(_NODE_OP_TYPE, "Gather")
              + encode_len_field(_NODE_ATTRIBUTE, axis))
    out.append(encode_len_field(_GRAPH_NODE, gather))
    return out


def _renamed(data: bytes, span: Span, numbers: tuple[int, ...]) -> bytes:
    """The message at `span` with its string fields `numbers` that say `logits` renamed."""
    out = bytearray()
    for number, wire, value in fields(data, *span):
        if wire == LEN and number in numbers and text(data, as_span(value)) == LOGITS_OUTPUT:
            out += encode_len_field(number, ALL_ROWS)
        else:
            out += field_bytes(data, number, wire, value)
    return bytes(out)


def _picked_output(data: bytes, span: Span) -> bytes:
    """The new `logits` output: [batch, 1, vocab] of the full logits' type."""
    logits = read_value_info(data, span)
    if logits.shape is None or len(logits.shape) != 3 or logits.shape[1] == 1:
        raise ModelStructureError(
            f"expected logits shaped [batch, rows, vocab] with a row per query row, got "
            f"{None if logits.shape is None else list(logits.shape)}; a decoder that returns "
            "one row already needs no row selection")
    dims = _dim_spans(data, span)
    shape = (field_bytes(data, _SHAPE_DIM, LEN, dims[0])
             + encode_len_field(_SHAPE_DIM, encode_varint_field(_DIM_VALUE, 1))
             + field_bytes(data, _SHAPE_DIM, LEN, dims[2]))
    return _value_info(LOGITS_OUTPUT, logits.elem_type or 0, shape)


def _dim_spans(data: bytes, span: Span) -> list[Span]:
    """The spans of the Dimension messages of a tensor ValueInfoProto's shape."""
    for number, wire, type_span in fields(data, *span):
        if number != _VALUE_TYPE or wire != LEN:
            continue
        for kind, kind_wire, tensor in fields(data, *as_span(type_span)):
            if kind != _TYPE_TENSOR or kind_wire != LEN:
                continue
            for field, field_wire, shape in fields(data, *as_span(tensor)):
                if field == _TENSOR_SHAPE and field_wire == LEN:
                    return [as_span(dim) for dim_number, dim_wire, dim
                            in fields(data, *as_span(shape))
                            if dim_number == _SHAPE_DIM and dim_wire == LEN]
    return []


def _value_info(name: str, elem_type: int, shape: bytes) -> bytes:
    """A tensor ValueInfoProto of `elem_type` with the encoded Dimension fields `shape`."""
    tensor = (encode_varint_field(_TENSOR_ELEM, elem_type)
              + encode_len_field(_TENSOR_SHAPE, shape))
    return (encode_len_field(_VALUE_NAME, name)
            + encode_len_field(_VALUE_TYPE, encode_len_field(_TYPE_TENSOR, tensor)))
