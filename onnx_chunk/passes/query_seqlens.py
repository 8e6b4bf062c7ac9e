"""Wire a `query_seqlens` graph input into every GroupQueryAttention (native padded chunks)."""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from onnx_chunk.errors import ConfigError
from onnx_chunk.graph import metadata
from onnx_chunk.graph.query_seqlens import (
    QUERY_SEQLENS,
    QUERY_SEQLENS_FED,
    lacking_reason,
    query_seqlens_index,
)
from onnx_chunk.passes import value_tracing
from onnx_chunk.passes.preconditions import ConfigPreconditionError
from onnx_chunk.passes.token_input import token_input

logger = logging.getLogger(__name__)

NATIVE_CHUNKS_CHOICES = ("auto", "on", "off")
_PAST_KEY_INPUT = 3
_PAST_VALUE_INPUT = 4


class QuerySeqlensPass(ir.passes.InPlacePass):
    """Give every GroupQueryAttention the `query_seqlens` input the installed ONNX Runtime has.

    With it the runtime runs a chunk right-padded to a ladder width with Q real rows per batch
    entry: only real rows enter the cache, Q = 0 leaves an entry untouched (onnx_chunk.
    query_seqlens). `seqlens_k` and `total_sequence_length` stay derived from attention_mask
    in the graph (ReduceSum - 1 and Shape, as the builder exports them): the runtime's mask
    holds past + Q ones per row and is at least the padded width wide.

    Rules:
    1. `mode` "off": an input wired by this pass is removed again (the GQA input, the graph
       input and the metadata key); nothing else changes.
    2. The installed ONNX Runtime's schema decides (never a version string): without the
       input, "auto" acts as "off" and "on" is a ConfigError naming the version.
    3. Not wired (a ConfigError for "on", nothing for "auto") when the graph has no
       GroupQueryAttention, no token input to take the batch axis from, a GQA without
       past_key/past_value (the operator requires them with query_seqlens), or a GQA whose
       query_seqlens slot is already fed by something else.
    4. Otherwise one int32 graph input `query_seqlens` feeds input `query_seqlens` of every
       GQA, and the metadata names it. Running the pass again changes nothing
       (`modified=False`).
    5. The input is optional for the model's other callers: it is also an initializer, empty
       by default, and GQA reads `Slice(Concat(query_seqlens, Expand(rows, [batch])), 0,
       batch)`. Fed `[batch]` values (the runtime), those are the real rows; left out
       (onnxruntime-genai, a plain ORT loop), every row of the chunk is real, the unpadded
       call. ONNX lets an initializer listed among the graph inputs be overridden (IR >= 4).
    """

    def __init__(self, mode: str = "auto", index: int | None = None) -> None:
        super().__init__()
        if mode not in NATIVE_CHUNKS_CHOICES:
            raise ConfigError(f"native chunks must be one of {', '.join(NATIVE_CHUNKS_CHOICES)},"
                              f" got {mode!r}")
        self.mode = mode
        # The schema's position of the input (read from the installed ONNX Runtime when the
        # pass first needs it); tests give one to act as another ONNX Runtime.
        self._index = index

    @property
    def index(self) -> int | None:
        """Where GroupQueryAttention takes query_seqlens here, None when it does not."""
        return query_seqlens_index() if self._index is None else self._index

    def requires(self, model: ir.Model) -> None:
        """Rules 2 and 3 for "on": the installed ONNX Runtime has the input and the graph can
        take it (ConfigError)."""
        if self.mode != "on":
            return
        index = self.index
        refusal = (lacking_reason() if index is None
                   else wiring_refusal(model.graph, value_tracing.gqa_nodes(model.graph), index))
        if refusal is not None:
            raise ConfigPreconditionError(f"--native-chunks on: {refusal}; convert with "
                                          "--native-chunks auto or off")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        nodes = value_tracing.gqa_nodes(graph)
        index = None if self.mode == "off" else self.index
        refusal = None if index is None else wiring_refusal(graph, nodes, index)
        if index is None or refusal is not None:
            if refusal is not None:
                logger.info("query_seqlens not wired: %s", refusal)
            modified = _unwire(graph, nodes)
            modified = metadata.write_query_seqlens(model, None) or modified
            return ir.passes.PassResult(model, modified=modified)
        modified = _wire(graph, nodes, index)
        modified = metadata.write_query_seqlens(model, QUERY_SEQLENS) or modified
        if modified:
            logger.info("query_seqlens wired into %d GroupQueryAttention nodes", len(nodes))
        return ir.passes.PassResult(model, modified=modified)


def wiring_refusal(graph: ir.Graph, nodes: list[ir.Node], index: int) -> str | None:
    """Why `query_seqlens` cannot be wired into `graph` (rule 3), or None."""
    if not nodes:
        return "the model has no GroupQueryAttention node"
    if token_input(graph) is None:
        return "the model has no token input (input_ids or inputs_embeds) to size it by"
    ours = (_graph_input(graph), _fed_value(graph))
    for node in nodes:
        if (value_tracing.input_at(node, _PAST_KEY_INPUT) is None
                or value_tracing.input_at(node, _PAST_VALUE_INPUT) is None):
            return f"GroupQueryAttention {node.name!r} has no past_key/past_value input"
        fed = value_tracing.input_at(node, index)
        if fed is not None and not any(fed is value for value in ours if value is not None):
            return (f"GroupQueryAttention {node.name!r} already takes {fed.name!r} as "
                    f"{QUERY_SEQLENS}")
    return None


def _graph_input(graph: ir.Graph) -> ir.Value | None:
    return next((value for value in graph.inputs if value.name == QUERY_SEQLENS), None)


_NODE_PREFIX = f"onnx_chunk/{QUERY_SEQLENS}/"


def _fed_value(graph: ir.Graph) -> ir.Value | None:
    """What every GQA reads: the defaulted query_seqlens of rule 5, once it is built."""
    return next((node.outputs[0] for node in graph
                 if node.name == f"{_NODE_PREFIX}slice"), None)


def _default_rows(graph: ir.Graph, value: ir.Value) -> ir.Value:
    """The nodes of rule 5, inserted at the top of the graph; returns their output."""
    token = token_input(graph)
    assert token is not None and token.shape is not None, "wiring_refusal checked it"

    def node(name: str, kind: str, inputs: list[ir.Value | None], **attributes) -> ir.Node:
        return ir.node(kind, inputs, attributes or None, name=f"{_NODE_PREFIX}{name}")

    zero = node("zero", "Constant", [], value=ir.tensor(np.array([0], dtype=np.int64)))
    rows = node("rows", "Shape", [token], start=1, end=2)
    batch = node("batch", "Shape", [token], start=0, end=1)
    cast = node("cast", "Cast", [rows.outputs[0]], to=ir.DataType.INT32)
    every = node("every", "Expand", [cast.outputs[0], batch.outputs[0]])
    joined = node("concat", "Concat", [value, every.outputs[0]], axis=0)
    sliced = node("slice", "Slice", [joined.outputs[0], zero.outputs[0], batch.outputs[0]])
    out = sliced.outputs[0]
    out.name = QUERY_SEQLENS_FED
    out.type, out.shape = ir.TensorType(ir.DataType.INT32), ir.Shape([token.shape[0]])
    built = [zero, rows, batch, cast, every, joined, sliced]
    first = next(iter(graph), None)
    if first is None:
        graph.extend(built)
    else:
        graph.insert_before(first, built)
    return out


def _wire(graph: ir.Graph, nodes: list[ir.Node], index: int) -> bool:
    value = _graph_input(graph)
    modified = False
    if value is None:
        value = ir.Value(name=QUERY_SEQLENS, type=ir.TensorType(ir.DataType.INT32),
                         shape=ir.Shape([f"{QUERY_SEQLENS}_entries"]),
                         const_value=ir.tensor(np.zeros((0,), dtype=np.int32),
                                               name=QUERY_SEQLENS))
        graph.inputs.append(value)
        graph.register_initializer(value)
        modified = True
    fed = _fed_value(graph)
    if fed is None:
        fed = _default_rows(graph, value)
        modified = True
    for node in nodes:
        if value_tracing.input_at(node, index) is fed:
            continue
        if len(node.inputs) <= index:
            node.resize_inputs(index + 1)
        node.replace_input_with(index, fed)
        modified = True
    return modified


def _unwire(graph: ir.Graph, nodes: list[ir.Node]) -> bool:
    value = _graph_input(graph)
    if value is None:
        return False
    fed = _fed_value(graph)
    for node in nodes:
        for position, source in enumerate(node.inputs):
            if source is value or (fed is not None and source is fed):
                node.replace_input_with(position, None)
        while node.inputs and node.inputs[-1] is None:
            node.resize_inputs(len(node.inputs) - 1)
    ours = [node for node in graph if node.name and node.name.startswith(_NODE_PREFIX)]
    if fed is not None and not fed.uses():
        graph.remove(ours, safe=True)
    if not value.uses():
        graph.inputs.remove(value)
        graph.initializers.pop(QUERY_SEQLENS, None)
    return True
