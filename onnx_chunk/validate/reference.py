"""The whole-prompt reference graph and the noise floor's: the decoder with its LM head
applied to one row of each forward, the last or one before it.

A whole-prompt forward of L rows makes [L, vocab] logits inside ONNX Runtime (726 MB for 1195
rows of a 151936-token vocabulary in float32), more than serving ever holds (it prefills W rows
at a time). The reference forwards compare only last rows (each chunk boundary's row comes
from a whole forward of that prefix), so they run on a copy of the graph whose LM head sees
the last row alone: its logits are [batch, 1, vocab] and the runtime treats it as a decoder
with last-row logits. The noise floor (numerics) reads the row before the last of a forward
one row longer, the same way (`from_end` 1).

Rules of `last_row_graph`:
1. The LM head is the MatMul-like node (MatMul, MatMulNBits, FusedMatMul, Gemm) reached from
   the `logits` output through elementwise nodes whose other inputs are constants (a Cast, a
   bias Add, a softcap's Div, Tanh and Mul). Its activation input gets a Slice of the row
   `from_end` rows before the last on axis 1, and the `logits` output's row dimension
   becomes 1. On a decoder converted with logits rows (`passes.logits_rows`), the Slice takes
   the rows before that pass's Gather, which the head then bypasses (the `logits_rows` input
   stays, read by nothing).
2. A decoder whose logits already keep one row, or whose LM head is not found that way, is
   used as it is (None).
3. `attention_noise_graph` is the last-row copy (or the graph itself, rule 2) with every
   attention node's output multiplied by 1 + one unit in the last place of its float type, so
   each value moves by one or two ulps: the rounding difference ONNX Runtime's attention makes
   between two cuts of the same rows (docs/row_grouping.md). The noise floor runs it to see
   what the rest of the model makes of such a difference (numerics).
4. A copy is the serialized graph alone, run in place of the file's (`Runtime(graph=...)`):
   ONNX Runtime reads its external data from the model's folder, which is never written, and
   no file of the model gets a second name (onnx.checker and onnx.load refuse external data
   with several hard links, so links would fail any other process checking the same model).
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from onnx_chunk.passes.logits_rows import NODE_PREFIX as LOGITS_ROWS_NODES

logger = logging.getLogger(__name__)

_HEADS = {"MatMul", "MatMulNBits", "FusedMatMul", "Gemm"}
_ELEMENTWISE = {"Cast", "Add", "Sub", "Mul", "Div", "Tanh", "Identity"}
_LOGITS = "logits"
# The ops whose rounding depends on how a forward's rows are cut (docs/row_grouping.md).
_ATTENTION = {"GroupQueryAttention", "MultiHeadAttention", "Attention"}
# 1 + one unit in the last place, by the elem type of the float the model computes in.
ONE_ULP_UP: dict[int, float] = {TensorProto.FLOAT: 1.0 + 2.0**-23,
                                TensorProto.FLOAT16: 1.0 + 2.0**-10,
                                TensorProto.BFLOAT16: 1.0 + 2.0**-7}


def last_row_graph(model_path: Path, from_end: int = 0) -> bytes | None:
    """The serialized copy of `model_path`'s graph whose LM head sees the row `from_end` rows
    before each forward's last (its external data left where it is), or None when the
    decoder is used as it is (rule 2)."""
    proto = onnx.load(str(model_path), load_external_data=False)
    if not slice_last_row(proto.graph, from_end):
        return None
    return proto.SerializeToString()


def attention_noise_graph(model_path: Path) -> tuple[bytes | None, int]:
    """Rule 3: the serialized copy of `model_path`'s graph, its LM head on the last row where
    `slice_last_row` applies, whose attention outputs are each one ulp up; and how many were.
    (None, 0) when the graph has no attention node."""
    proto = onnx.load(str(model_path), load_external_data=False)
    slice_last_row(proto.graph)
    count = perturb_attention(proto.graph)
    return (proto.SerializeToString(), count) if count else (None, 0)


def perturb_attention(graph: onnx.GraphProto) -> int:
    """Rule 3 on `graph`, in place: each attention node's first output, multiplied by
    1 + one ulp of the type the model computes in (its first floating past or logits type),
    under its own name; returns how many nodes were perturbed."""
    dtype = _compute_type(graph)
    factor = helper.make_tensor("validate/one_ulp_up", dtype, [], [ONE_ULP_UP[dtype]])
    nodes = []
    for node in graph.node:
        nodes.append(node)
        if node.op_type in _ATTENTION and node.output and node.output[0]:
            name = node.output[0]
            node.output[0] = f"{name}/validate_unperturbed"
            nodes.append(helper.make_node("Mul", [node.output[0], factor.name], [name],
                                          name=f"{name}/validate_perturb"))
    count = len(nodes) - len(graph.node)
    if count:
        graph.initializer.append(factor)
        del graph.node[:]
        graph.node.extend(nodes)
    return count


def _compute_type(graph: onnx.GraphProto) -> int:
    """The float type attention computes in: the first past KV input's, else the logits'."""
    values = [value for value in graph.input if value.name.startswith("past")]
    values += [value for value in graph.output if value.name == _LOGITS]
    for value in values:
        elem = value.type.tensor_type.elem_type
        if elem in ONE_ULP_UP:
            return elem
    return TensorProto.FLOAT


def slice_last_row(graph: onnx.GraphProto, from_end: int = 0) -> bool:
    """Rules 1 and 2 on `graph`, in place: whether its LM head now sees one row only, the row
    `from_end` rows before the last."""
    output = next((value for value in graph.output if value.name == _LOGITS), None)
    if output is None:
        return False
    dims = output.type.tensor_type.shape.dim
    if len(dims) != 3 or (dims[1].HasField("dim_value") and dims[1].dim_value == 1):
        return False
    constants = {tensor.name for tensor in graph.initializer}
    constants |= {out for node in graph.node if node.op_type == "Constant" for out in node.output}
    producers = {out: node for node in graph.node for out in node.output}
    node = producers.get(_LOGITS)
    while node is not None and node.op_type in _ELEMENTWISE:
        varying = [name for name in node.input if name and name not in constants]
        if len(varying) != 1:
            return False
        node = producers.get(varying[0])
    if node is None or node.op_type not in _HEADS:
        logger.info("no LM head found before the logits; the reference computes every row")
        return False
    rows = node.input[0]
    chosen = producers.get(rows)
    if chosen is not None and chosen.name == f"{LOGITS_ROWS_NODES}gather":
        rows = chosen.input[0]  # the rows before logits_rows' Gather (rule 1)
    last = f"{rows}/validate_row_{from_end}_from_end"
    end = -from_end if from_end else 2**62
    bounds = [helper.make_tensor(f"{last}/{name}", TensorProto.INT64, [1], [value])
              for name, value in (("starts", -1 - from_end), ("ends", end), ("axes", 1))]
    graph.initializer.extend(bounds)
    node.input[0] = last
    nodes = list(graph.node)
    # Just before the head, whose input is produced earlier: the graph stays sorted.
    nodes.insert(nodes.index(node), helper.make_node(
        "Slice", [rows] + [bound.name for bound in bounds], [last], name=last))
    del graph.node[:]
    graph.node.extend(nodes)
    dims[1].Clear()
    dims[1].dim_value = 1
    for info in graph.value_info:
        if info.name == _LOGITS:
            graph.value_info.remove(info)
            break
    return True

