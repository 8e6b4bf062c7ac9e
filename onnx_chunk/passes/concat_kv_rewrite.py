"""What both concat-KV rewrites share: the pass that refuses or rewrites a copy, and the builder
that adds a target's nodes and finishes the graph (ConcatKVToGQAPass rules 5-8)."""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.graph import metadata
from onnx_chunk.passes import value_tracing
from onnx_chunk.passes.concat_kv_layers import (
    KV_RANK,
    MASK_INPUT,
    ConcatKVLayer,
    find_concat_kv_attention,
    label,
    scalar,
)
from onnx_chunk.passes.preconditions import ModelPreconditionError

logger = logging.getLogger(__name__)

_SEQUENCE_AXIS = 2


class ConcatKVRewritePass(ir.passes.FunctionalPass):
    """What both concat-KV targets share: refuse a model whose layers do not all match
    (`requires()`), rewrite the layers in a copy, record `max_sequence_length`. Subclasses say
    what a layer becomes (`target`, `rewrite`)."""

    target = ""

    def __init__(self, max_sequence_length: int | None = None) -> None:
        super().__init__()
        self.max_sequence_length = max_sequence_length

    def rewrite(self, model: ir.Model, layers: tuple[ConcatKVLayer, ...]) -> None:
        """Rewrite the matched `layers` of `model` (a copy) in place."""
        raise NotImplementedError(f"{type(self).__name__} does not say what a layer becomes")

    def requires(self, model: ir.Model) -> None:
        """Rule 5: every concat-KV layer matches (ModelStructureError naming the node where the
        closest match stopped)."""
        refusal = find_concat_kv_attention(model.graph).refusal
        if refusal is not None:
            raise ModelPreconditionError(
                f"the model grows its KV cache by Concat, but {refusal}; nothing was "
                "rewritten. Export it with onnxruntime-genai's model builder, or report the "
                "layout")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        findings = find_concat_kv_attention(model.graph)
        if not findings.concat_kv:
            # A functional pass returns a new model even when it changes nothing.
            return ir.passes.PassResult(model.clone(), modified=False)
        assert findings.refusal is None, "requires() checked it"
        rewritten = model.clone()
        self.rewrite(rewritten, findings.layers)
        metadata.write_max_positions(rewritten, self.max_sequence_length)
        logger.info("concat KV: %d layers rewritten to %s", len(findings.layers), self.target)
        return ir.passes.PassResult(rewritten, modified=True)


class RewriteBuilder:
    """Adds the nodes of a concat-KV rewrite to `model` and finishes it (rules 6 and 7).

    Shared with the opset 24 target (concat_kv_tensor_scatter): both replace each layer's
    attention and hand the present outputs over to the node that keeps the KV at capacity.
    """

    def __init__(self, model: ir.Model, prefix: str) -> None:
        self.model = model
        self.prefix = prefix
        self.values = _values_by_name(model.graph)
        self.mask = self.values[MASK_INPUT]
        self._nodes: list[ir.Node] = []

    def add(self, node: ir.Node) -> ir.Node:
        self._nodes.append(node)
        return node

    def node(self, op: str, inputs, name: str, domain: str = "", **attributes) -> ir.Value:
        created = self.add(ir.node(op, inputs, attributes, domain=domain,
                                   name=f"{self.prefix}/{name}"))
        created.outputs[0].name = f"{self.prefix}/{name}/output_0"
        return created.outputs[0]

    def constant(self, name: str, data) -> ir.Value:
        tensor = ir.tensor(np.asarray(data, dtype=np.int64), name=f"{self.prefix}/{name}")
        value = ir.Value(name=tensor.name, shape=ir.Shape(tensor.shape.numpy()),
                         type=ir.TensorType(tensor.dtype),
                         const_value=tensor)
        self.model.graph.register_initializer(value)
        return value

    def take_over_output(self, old_name: str, new: ir.Value) -> None:
        """Make `new` the graph output `old_name` was; the present spans the mask's width as
        in builder exports ([batch, kv_heads, total_sequence_length, head])."""
        graph, old = self.model.graph, self.values[old_name]
        position = list(graph.outputs).index(old)
        old.name = f"{old_name}/concat"
        new.name = old_name
        if old.dtype is not None:
            new.dtype = old.dtype
        if old.shape is not None and self.mask.shape is not None:
            dims = list(old.shape)
            dims[_SEQUENCE_AXIS] = self.mask.shape[1]
            new.shape = ir.Shape(dims)
        graph.outputs[position] = new

    def finish(self, layers: tuple[ConcatKVLayer, ...], keeps_kv) -> None:
        """Add the nodes, drop what died, sort, then check that the past inputs feed only
        `keeps_kv` nodes and shape reads that miss the sequence axis."""
        self.model.graph.extend(self._nodes)
        RemoveUnusedNodesPass()(self.model)
        TopologicalSortPass()(self.model)
        inputs = {value.name: value for value in self.model.graph.inputs}
        for layer in layers:
            for name in (layer.past_key, layer.past_value):
                others = [node for node in inputs[name].consumers()
                          if not keeps_kv(node) and reads_sequence_axis(node)]
                if others:
                    raise ModelStructureError(
                        f"after the concat-KV rewrite the past input {name!r} still feeds "
                        f"{label(others[0])}, which would read the capacity-sized buffer as "
                        "a grown cache; nothing was rewritten. Report the layout")



def _values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    found = {value_tracing.name_of(value): value for value in graph.inputs}
    found.update(graph.initializers)
    for node in graph:
        found.update({name: output for output in node.outputs if (name := output.name)})
    return found


def reads_sequence_axis(node: ir.Node) -> bool:
    """Whether a node reading a past input could see its sequence axis (now the capacity)."""
    if node.op_type != "Shape":
        return True
    start = node.attributes.get("start")
    end = node.attributes.get("end")
    first = start.as_int() if start is not None else 0
    last = end.as_int() if end is not None else KV_RANK
    first, last = (axis + KV_RANK if axis < 0 else axis for axis in (first, last))
    if not first <= _SEQUENCE_AXIS < last:
        return False
    # Fine only when every reader gathers one fixed axis other than the sequence axis.
    readers = node.outputs[0].consumers()
    for reader in readers:
        index = scalar(reader.inputs[1]) if reader.op_type == "Gather" else None
        if index is None:
            return True
        axis = first + (int(index) if index >= 0 else int(index) + last - first)
        if axis == _SEQUENCE_AXIS:
            return True
    return not readers
