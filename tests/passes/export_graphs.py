"""The corpus's exports as onnx_ir models, and the small edits tests make to them."""

from __future__ import annotations

import onnx_ir as ir

from tests.exports.corpus import fixtures


def load_export(name: str) -> ir.Model:
    """The fixture `name`'s model.onnx (a fresh object each call)."""
    return ir.load(next(fixture.folder for fixture in fixtures() if fixture.name == name)
                   / "model.onnx")


def insert_after(model: ir.Model, node_name: str, op: str) -> str:
    """Put a one-input `op` node behind node `node_name`'s output; returns its name."""
    node = next(node for node in model.graph if node.name == node_name)
    inserted = ir.node(op, [node.outputs[0]], name=f"{node_name}/{op}")
    ir.convenience.replace_all_uses_with(node.outputs[0], inserted.outputs[0])
    inserted.replace_input_with(0, node.outputs[0])
    model.graph.insert_after(node, inserted)
    return inserted.name
