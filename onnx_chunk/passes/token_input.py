"""Find a decoder's token input and the symbolic names of its batch and query axes."""

from __future__ import annotations

import onnx_ir as ir

from onnx_chunk.passes import value_tracing

TOKEN_INPUTS = ("input_ids", "inputs_embeds")
ATTENTION_MASK = "attention_mask"
INTEGER_TYPES = (ir.DataType.INT64, ir.DataType.INT32)


def token_input(graph: ir.Graph) -> ir.Value | None:
    """The input that carries the query tokens.

    `input_ids`, else `inputs_embeds`, else the integer [batch, rows] input a Gather reads as
    indices (an embedding lookup); None when there is none.
    """
    by_name = {value.name: value for value in graph.inputs}
    for name in TOKEN_INPUTS:
        if name in by_name:
            return by_name[name]
    for value in graph.inputs:
        if (value.dtype in INTEGER_TYPES and value.shape is not None and len(value.shape) == 2
                and any(use.node.op_type == "Gather" and use.idx == 1 for use in value.uses())):
            return value
    return None


def axis_keys(value: ir.Value) -> tuple[int | str | None, int | str | None]:
    """The batch (axis 0) and query (axis 1) keys of a token input; None where unknown."""
    shape = value.shape
    if shape is None or len(shape) < 2:
        return None, None
    return value_tracing.dim_key(shape[0]), value_tracing.dim_key(shape[1])


def has_query_axis(value: ir.Value, rows_key: int | str | None) -> bool:
    """Whether `value`'s axis 1 has the query axis's symbolic name `rows_key`."""
    shape = value.shape
    return (isinstance(rows_key, str) and shape is not None and len(shape) >= 2
            and value_tracing.dim_key(shape[1]) == rows_key)
