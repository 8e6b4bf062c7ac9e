"""Compute the logits of chosen query rows only, before the lm_head instead of after it.

A builder export computes the lm_head for every query row, though a prefill chunk needs one
row (the last real one) and a decode step has one. On qwen05-int4 (Qwen2.5-0.5B's shape, a
151936-token vocabulary) the lm_head of a 512-row chunk is 139 of the forward's 506 GFLOP and
30% of its CPU time (docs/benchmarks.md, "Prefill candidates on CPU"). llama.cpp selects the
rows before its output matrix (its `inp_out_ids`); this pass does the same in the graph.

Rules:
1. The lm_head is the MatMul, MatMulNBits or Gemm that writes the graph output `logits`,
   directly or through row-wise elementwise nodes whose other operands are constants
   (gemma2's soft-capping Div, Tanh, Mul; a bias Add; a Cast). Anything else between them,
   or no `logits` output, is refused with ModelStructureError naming what was found.
2. The logits' axis 1 must be the token input's query axis (a symbolic name); otherwise the
   rows cannot be chosen and the pass refuses.
3. A graph input `logits_rows` (int64, [logits_rows]) is added and the lm_head reads
   `Gather(hidden, logits_rows, axis=1)` instead of the hidden state, so `logits` is
   [batch, logits_rows, vocab]: row r of the output is query row logits_rows[r] (negative
   indices count from the end, as Gather's do). The values between the head and the output
   get the new axis name; nothing else changes and weights are not read.
4. A graph that already has a `logits_rows` input is left as it is (modified False).

The runtime binds `logits_rows` per forward: the last real row of a prefill chunk, [0] for a
decode step, every row (0..W-1) where all rows' logits are needed (speculative verification).
Today's runtime refuses an input it does not know, so LogitsRowsPass needs that support first.

LastRowLogitsPass is the variant today's runtime serves as it is: rules 1, 2 and 4 hold (its
marker is a logits axis 1 fixed at 1), and rule 3 becomes a `Slice` of the lm_head's input to
its last row, so `logits` is [batch, 1, vocab]. The runtime reads such a decoder as one that
keeps the last row only (`ModelPorts.last_row_logits`): it refuses speculative decoding and
all-row prompt logits for it and switches ladder padding off (a padded chunk's last row is a
padded position).
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.passes import value_tracing
from onnx_chunk.passes.token_input import axis_keys, token_input

logger = logging.getLogger(__name__)

LOGITS = "logits"
LOGITS_ROWS = "logits_rows"
HEAD_OPS = ("MatMul", "MatMulNBits", "Gemm")
# Row-wise nodes allowed between the lm_head and the logits (their other operands constant).
ROW_WISE_OPS = ("Add", "Sub", "Mul", "Div", "Tanh", "Cast", "Softcap", "Identity")


class LogitsRowsPass(ir.passes.InPlacePass):
    """Add the `logits_rows` input and select those rows before the lm_head (module rules)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if any(value.name == LOGITS_ROWS for value in graph.inputs):
            return ir.passes.PassResult(model, modified=False)
        head, chain = _checked_head(graph)
        rows = ir.Value(name=LOGITS_ROWS, type=ir.TensorType(ir.DataType.INT64),
                        shape=ir.Shape([LOGITS_ROWS]))
        graph.inputs.append(rows)
        hidden = head.inputs[0]
        assert hidden is not None, "find_lm_head checked the head's input"
        gather = ir.node("Gather", inputs=[hidden, rows], attributes={"axis": 1},
                         name=f"{head.name or 'lm_head'}/logits_rows")
        gathered = gather.outputs[0]
        gathered.name = f"{hidden.name}/logits_rows"
        _copy_type(hidden, gathered, LOGITS_ROWS)
        graph.insert_before(head, gather)
        head.replace_input_with(0, gathered)
        for value in (head.outputs[0], *chain):
            if value.shape is not None and len(value.shape) >= 2:
                value.shape = _with_rows(value.shape, LOGITS_ROWS)
        logger.info("logits rows: %s reads the %s rows of %s", head.name, LOGITS_ROWS,
                    hidden.name)
        return ir.passes.PassResult(model, modified=True)


class LastRowLogitsPass(ir.passes.InPlacePass):
    """Slice the lm_head's input to the last query row: `logits` [batch, 1, vocab] (module
    rules)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        output = _logits_output(graph)
        if output.shape is not None and len(output.shape) >= 2 and output.shape[1] == 1:
            return ir.passes.PassResult(model, modified=False)
        head, chain = _checked_head(graph)
        hidden = head.inputs[0]
        assert hidden is not None, "find_lm_head checked the head's input"
        constants = [ir.Value(name=f"{hidden.name}/last_row/{name}",
                              const_value=ir.tensor([value], dtype=ir.DataType.INT64))
                     for name, value in (("starts", -1), ("ends", 2 ** 62), ("axes", 1))]
        for constant in constants:
            constant.shape = ir.Shape([1])
            constant.dtype = ir.DataType.INT64
            graph.register_initializer(constant)
        slice_ = ir.node("Slice", inputs=[hidden, *constants],
                         name=f"{head.name or 'lm_head'}/last_row")
        sliced = slice_.outputs[0]
        sliced.name = f"{hidden.name}/last_row"
        _copy_type(hidden, sliced, 1)
        graph.insert_before(head, slice_)
        head.replace_input_with(0, sliced)
        for value in (head.outputs[0], *chain):
            if value.shape is not None and len(value.shape) >= 2:
                value.shape = _with_rows(value.shape, 1)
        logger.info("last-row logits: %s reads the last row of %s", head.name, hidden.name)
        return ir.passes.PassResult(model, modified=True)


def _checked_head(graph: ir.Graph) -> tuple[ir.Node, list[ir.Value]]:
    """find_lm_head, with rule 2 checked."""
    head, chain = find_lm_head(graph)
    output = _logits_output(graph)
    token = token_input(graph)
    rows_key = axis_keys(token)[1] if token is not None else None
    logits_rows_key = (value_tracing.dim_key(output.shape[1])
                       if output.shape is not None and len(output.shape) >= 2 else None)
    if not isinstance(rows_key, str) or logits_rows_key != rows_key:
        raise ModelStructureError(
            f"the logits are shaped {value_tracing.shape_text(output.shape)} and the token "
            f"input's query axis is {rows_key!r}: axis 1 of the logits must be the query "
            "axis for logits rows to be chosen")
    return head, chain


def _copy_type(source: ir.Value, target: ir.Value, rows: int | str) -> None:
    if source.dtype is not None:
        target.dtype = source.dtype
    if source.shape is not None and len(source.shape) >= 2:
        target.shape = _with_rows(source.shape, rows)


def _logits_output(graph: ir.Graph) -> ir.Value:
    for value in graph.outputs:
        if value.name == LOGITS:
            return value
    names = ", ".join(str(value.name) for value in graph.outputs) or "none"
    raise ModelStructureError(f"the graph has no {LOGITS!r} output (its outputs: {names})")


def find_lm_head(graph: ir.Graph) -> tuple[ir.Node, list[ir.Value]]:
    """The node that computes the logits (rule 1) and the values from its output to `logits`."""
    value = _logits_output(graph)
    chain: list[ir.Value] = []
    while True:
        node = value.producer()
        if node is None:
            raise ModelStructureError(f"{LOGITS!r} is not computed by a node")
        if node.op_type in HEAD_OPS and node.domain in ("", "ai.onnx", "com.microsoft"):
            if node.inputs[0] is None or (len(node.inputs) > 1 and node.inputs[1] is not None
                                          and not _constant(node.inputs[1])):
                raise ModelStructureError(
                    f"the {LOGITS!r} node {node.name!r} ({node.op_type}) has no constant "
                    "weight, so it is not an lm_head")
            return node, chain
        data = _row_wise_input(node)
        if data is None:
            raise ModelStructureError(
                f"between the lm_head and {LOGITS!r} there is {node.op_type} node "
                f"{node.name!r}, which is not row-wise with constant operands; the logits "
                "rows cannot be chosen before the lm_head")
        chain.append(value)
        value = data


def _row_wise_input(node: ir.Node) -> ir.Value | None:
    """The one non-constant input of a row-wise elementwise node, else None."""
    if node.op_type not in ROW_WISE_OPS or node.domain not in ("", "ai.onnx", "com.microsoft"):
        return None
    variable = [value for value in node.inputs if value is not None and not _constant(value)]
    if len(variable) != 1:
        return None
    others = [value for value in node.inputs if value is not None and value is not variable[0]]
    # A constant operand broadcast along the rows must not itself have a row axis.
    if any(value.shape is None or len(value.shape) > 1 for value in others):
        return None
    return variable[0]


def _constant(value: ir.Value) -> bool:
    producer = value.producer()
    return value.is_initializer() or (producer is not None and producer.op_type == "Constant")


def _with_rows(shape: ir.Shape, rows: int | str) -> ir.Shape:
    dims: list[int | ir.SymbolicDim] = list(shape)
    dims[1] = ir.SymbolicDim(rows) if isinstance(rows, str) else rows
    return ir.Shape(dims)
