"""Wire a `query_seqlens` graph input into every GroupQueryAttention (native padded chunks)."""

from __future__ import annotations

import logging

import onnx_ir as ir

from onnx_chunk import metadata
from onnx_chunk.errors import ConfigError
from onnx_chunk.passes import value_tracing
from onnx_chunk.passes.token_input import token_input
from onnx_chunk.query_seqlens import QUERY_SEQLENS, lacking_reason, query_seqlens_index

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
    4. Otherwise one int32 graph input `query_seqlens` [batch] (the token input's batch
       axis) feeds input `query_seqlens` of every GQA, and the metadata names it. Running the
       pass again changes nothing (`modified=False`).
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

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        nodes = value_tracing.gqa_nodes(graph)
        index = None if self.mode == "off" else self.index
        if index is None and self.mode != "on":
            modified = _unwire(graph, nodes)
            modified = metadata.write_query_seqlens(model, None) or modified
            return ir.passes.PassResult(model, modified=modified)
        if index is None:
            raise ConfigError(f"--native-chunks on: {lacking_reason()}; convert with "
                              "--native-chunks auto or off")
        refusal = wiring_refusal(graph, nodes, index)
        if refusal is not None:
            if self.mode == "on":
                raise ConfigError(f"--native-chunks on: {refusal}; convert with "
                                  "--native-chunks auto or off")
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
    ours = _graph_input(graph)
    for node in nodes:
        if (value_tracing.input_at(node, _PAST_KEY_INPUT) is None
                or value_tracing.input_at(node, _PAST_VALUE_INPUT) is None):
            return f"GroupQueryAttention {node.name!r} has no past_key/past_value input"
        fed = value_tracing.input_at(node, index)
        if fed is not None and fed is not ours:
            return (f"GroupQueryAttention {node.name!r} already takes {fed.name!r} as "
                    f"{QUERY_SEQLENS}")
    return None


def _graph_input(graph: ir.Graph) -> ir.Value | None:
    return next((value for value in graph.inputs if value.name == QUERY_SEQLENS), None)


def _wire(graph: ir.Graph, nodes: list[ir.Node], index: int) -> bool:
    value = _graph_input(graph)
    modified = False
    if value is None:
        token = token_input(graph)
        assert token is not None and token.shape is not None, "wiring_refusal checked it"
        value = ir.Value(name=QUERY_SEQLENS, type=ir.TensorType(ir.DataType.INT32),
                         shape=ir.Shape([token.shape[0]]))
        graph.inputs.append(value)
        modified = True
    for node in nodes:
        if value_tracing.input_at(node, index) is value:
            continue
        if len(node.inputs) <= index:
            node.resize_inputs(index + 1)
        node.replace_input_with(index, value)
        modified = True
    return modified


def _unwire(graph: ir.Graph, nodes: list[ir.Node]) -> bool:
    value = _graph_input(graph)
    if value is None:
        return False
    for node in nodes:
        for position, fed in enumerate(node.inputs):
            if fed is value:
                node.replace_input_with(position, None)
        while node.inputs and node.inputs[-1] is None:
            node.resize_inputs(len(node.inputs) - 1)
    if not value.uses():
        graph.inputs.remove(value)
    return True
