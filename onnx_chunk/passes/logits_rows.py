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
   `Gather(hidden, rows, axis=1)` instead of the hidden state, so `logits` is
   [batch, logits_rows, vocab]: row r of the output is query row logits_rows[r] (negative
   indices count from the end, as Gather's do). The values between the head and the output
   get the new axis name; nothing else changes and weights are not read. The metadata
   (`onnx_chunk.logits_rows`) names the input.
4. The input is optional: it is also an initializer, empty by default, and an empty
   `logits_rows` selects every row (`Slice(Concat(logits_rows, Range(rows)), 0, n)` with n
   its size, or the query width when it is 0), so a caller that leaves it out (onnxruntime-
   genai, a plain ORT loop) gets the logits of the unconverted graph.
5. Running the pass again changes nothing (`modified=False`). `mode` "off" removes a wiring
   of this pass (nodes, input, initializer, metadata); "auto" wires where rules 1 and 2 hold
   and leaves the graph as it is otherwise; "on" refuses there with ConfigError.

The runtime (`ModelPorts.logits_rows`) feeds per forward the last real row of a prefill
chunk, [0] for a decode step, and every real row where all rows' logits are needed (prompt
logprobs, speculative verification, validate's comparison).

LastRowLogitsPass is the fixed variant (no input): rules 1 and 2 hold (its marker is a logits
axis 1 fixed at 1), and rule 3 becomes a `Slice` of the lm_head's input to its last row, so
`logits` is [batch, 1, vocab]. The runtime reads such a decoder as one that keeps the last row
only (`ModelPorts.last_row_logits`): it refuses speculative decoding and all-row prompt logits
for it and switches ladder padding off (a padded chunk's last row is a padded position).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from onnx_chunk.errors import ConfigError, ModelStructureError
from onnx_chunk.graph import metadata
from onnx_chunk.passes import value_tracing
from onnx_chunk.passes.preconditions import ConfigPreconditionError, precondition
from onnx_chunk.passes.token_input import axis_keys, token_input

logger = logging.getLogger(__name__)

LOGITS = "logits"
LOGITS_ROWS = "logits_rows"
LOGITS_ROWS_CHOICES = ("auto", "on", "off")
HEAD_OPS = ("MatMul", "MatMulNBits", "Gemm")
# Row-wise nodes allowed between the lm_head and the logits (their other operands constant).
ROW_WISE_OPS = ("Add", "Sub", "Mul", "Div", "Tanh", "Cast", "Softcap", "Identity")
NODE_PREFIX = f"onnx_chunk/{LOGITS_ROWS}/"


class LogitsRowsPass(ir.passes.InPlacePass):
    """Add the optional `logits_rows` input and select those rows before the lm_head (module
    rules)."""

    def __init__(self, mode: str = "on") -> None:
        super().__init__()
        if mode not in LOGITS_ROWS_CHOICES:
            raise ConfigError(f"logits rows must be one of {', '.join(LOGITS_ROWS_CHOICES)}, "
                              f"got {mode!r}")
        self.mode = mode

    def requires(self, model: ir.Model) -> None:
        """Rules 1 and 2 for "on", unless the input is wired already (ConfigError)."""
        if self.mode != "on" or _graph_input(model.graph) is not None:
            return
        try:
            _checked_head(model.graph)
        except ModelStructureError as error:
            raise ConfigPreconditionError(f"--logits-rows on: {error}; convert with "
                                          "--logits-rows auto or off") from error

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if self.mode == "off":
            modified = _unwire(graph)
            modified = metadata.write_logits_rows(model, None) or modified
            return ir.passes.PassResult(model, modified=modified)
        if _graph_input(graph) is not None:
            modified = metadata.write_logits_rows(model, LOGITS_ROWS)
            return ir.passes.PassResult(model, modified=modified)
        try:
            head, chain = _checked_head(graph)
        except ModelStructureError as error:
            logger.info("logits rows not wired: %s", error)
            return ir.passes.PassResult(model, modified=False)
        _wire(graph, head, chain)
        metadata.write_logits_rows(model, LOGITS_ROWS)
        logger.info("logits rows: %s reads the %s rows of its input", head.name, LOGITS_ROWS)
        return ir.passes.PassResult(model, modified=True)


def _graph_input(graph: ir.Graph) -> ir.Value | None:
    return next((value for value in graph.inputs if value.name == LOGITS_ROWS), None)


def _wire(graph: ir.Graph, head: ir.Node, chain: list[ir.Value]) -> None:
    """Rules 3 and 4: the input, its default of every row and the Gather before `head`."""
    rows = ir.Value(name=LOGITS_ROWS, type=ir.TensorType(ir.DataType.INT64),
                    shape=ir.Shape([LOGITS_ROWS]),
                    const_value=ir.tensor(np.zeros((0,), dtype=np.int64), name=LOGITS_ROWS))
    graph.inputs.append(rows)
    graph.register_initializer(rows)
    hidden = head.inputs[0]
    assert hidden is not None, "find_lm_head checked the head's input"

    def node(name: str, kind: str, inputs: list[ir.Value | None], **attributes) -> ir.Node:
        return ir.node(kind, inputs, attributes or None, name=f"{NODE_PREFIX}{name}")

    def constant(name: str, value: np.ndarray) -> ir.Node:
        return node(name, "Constant", [], value=ir.tensor(value))

    zero, one, axis, flat = (constant("zero", np.array(0, np.int64)),
                             constant("one", np.array(1, np.int64)),
                             constant("axis", np.array(1, np.int64)),
                             constant("flat", np.array([1], np.int64)))
    shape = node("shape", "Shape", [hidden])
    width = node("width", "Gather", [shape.outputs[0], axis.outputs[0]], axis=0)
    every = node("every", "Range", [zero.outputs[0], width.outputs[0], one.outputs[0]])
    size = node("size", "Size", [rows])
    given = node("given", "Greater", [size.outputs[0], zero.outputs[0]])
    count = node("count", "Where", [given.outputs[0], size.outputs[0], width.outputs[0]])
    end = node("end", "Reshape", [count.outputs[0], flat.outputs[0]])
    start = constant("start", np.array([0], np.int64))
    joined = node("concat", "Concat", [rows, every.outputs[0]], axis=0)
    chosen = node("chosen", "Slice", [joined.outputs[0], start.outputs[0], end.outputs[0]])
    gather = node("gather", "Gather", [hidden, chosen.outputs[0]], axis=1)
    gathered = gather.outputs[0]
    gathered.name = f"{hidden.name}/logits_rows"
    _copy_type(hidden, gathered, LOGITS_ROWS)
    graph.insert_before(head, [zero, one, axis, flat, shape, width, every, size, given, count,
                               end, start, joined, chosen, gather])
    head.replace_input_with(0, gathered)
    for value in (head.outputs[0], *chain):
        if value.shape is not None and len(value.shape) >= 2:
            value.shape = _with_rows(value.shape, LOGITS_ROWS)


def _unwire(graph: ir.Graph) -> bool:
    """Rule 5's "off": the graph as it was before `_wire`."""
    rows = _graph_input(graph)
    if rows is None:
        return False
    gather = next((node for node in graph if node.name == f"{NODE_PREFIX}gather"), None)
    if gather is not None:
        hidden = gather.inputs[0]
        assert hidden is not None
        token = token_input(graph)
        query = axis_keys(token)[1] if token is not None else None
        for use in list(gather.outputs[0].uses()):
            use.node.replace_input_with(use.idx, hidden)
            values = [use.node.outputs[0]]
            while values and isinstance(query, str):
                value = values.pop()
                if value.shape is not None and len(value.shape) >= 2 and \
                        str(value.shape[1]) == LOGITS_ROWS:
                    value.shape = _with_rows(value.shape, query)
                    values += [out for consumer in value.consumers() for out in consumer.outputs]
    ours = [node for node in graph if node.name and node.name.startswith(NODE_PREFIX)]
    graph.remove(ours, safe=True)
    graph.inputs.remove(rows)
    graph.initializers.pop(LOGITS_ROWS, None)
    return True


class LastRowLogitsPass(ir.passes.InPlacePass):
    """Slice the lm_head's input to the last query row: `logits` [batch, 1, vocab] (module
    rules)."""

    def requires(self, model: ir.Model) -> None:
        """Rules 1 and 2, unless the logits are one row already (ModelStructureError)."""
        with precondition():
            if not _one_row(model.graph):
                _checked_head(model.graph)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if _one_row(graph):
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


def _one_row(graph: ir.Graph) -> bool:
    """Whether the logits are [batch, 1, vocab] (LastRowLogitsPass's marker)."""
    output = _logits_output(graph)
    return output.shape is not None and len(output.shape) >= 2 and output.shape[1] == 1


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
