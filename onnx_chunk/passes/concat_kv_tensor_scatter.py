"""Rewrite a concat-KV decoder to standard opset 24 TensorScatter + Attention at capacity.

For providers without Microsoft contrib ops: the KV cache is a fixed-capacity buffer that
`TensorScatter` writes the new rows into (in place when the runtime binds the past and present
to one buffer, as it does), and `Attention` reads with `nonpad_kv_seqlen` and a causal mask
offset by the past length. The layers are found by concat_kv_layers' onnxscript patterns.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_chunk.passes import value_tracing
from onnx_chunk.passes.concat_kv_layers import ConcatKVLayer
from onnx_chunk.passes.concat_kv_rewrite import ConcatKVRewritePass, RewriteBuilder

OPSET = 24
# TensorScatter and Attention's nonpad_kv_seqlen need IR version 11 (ONNX 1.19).
IR_VERSION = 11
_SEQUENCE_AXIS = 2
_QUERY_ROWS_AXIS = 2


class ConcatKVToTensorScatterPass(ConcatKVRewritePass):
    """Rewrite every concat-KV layer to TensorScatter + Attention (opset 24) at capacity.

    Rules:
    1. Layers are matched, and refused, exactly as ConcatKVToGQAPass matches them (rules 1-5
       there); a model without concat KV comes back as an unchanged copy.
    2. Shared by all layers: valid = ReduceSum(attention_mask, axis 1) (past + rows),
       write_indices = valid - rows (the past length, where the new rows go), the key
       positions Range(capacity) and the mask `key position <= past + row` [batch, 1, rows,
       capacity], which is causal and hides the unwritten tail.
    3. Per layer: present key/value = TensorScatter(past, new rows, write_indices, axis 2),
       taking over the graph's present outputs; Attention(Q, present key, present value,
       mask, nonpad_kv_seqlen=valid) with the matched scale, Q/K/V in [batch, heads, rows,
       head] (Attention repeats the KV heads itself); its output replaces the old one.
    4. The default opset becomes 24 (IR version at least 11); rotary stays as exported; the
       old attention dies and is removed; the past inputs must then feed only TensorScatter.
    5. `max_sequence_length` is recorded as by ConcatKVToGQAPass.
    """

    target = f"TensorScatter + Attention (opset {OPSET})"

    def rewrite(self, model: ir.Model, layers: tuple[ConcatKVLayer, ...]) -> None:
        _rewrite(model, layers)


def _rewrite(model: ir.Model, layers: tuple[ConcatKVLayer, ...]) -> None:
    build = RewriteBuilder(model, "/onnx_chunk/tensor_scatter")
    values, mask = build.values, build.mask
    model.opset_imports[""] = OPSET
    model.ir_version = max(model.ir_version or 0, IR_VERSION)
    one, zero = build.constant("one", [1]), build.constant("zero", 0)
    valid = build.node("ReduceSum", [mask, one], "valid", keepdims=0)
    rows = build.node("Gather", [build.node("Shape", [values[layers[0].query]], "QueryShape"),
                                 build.constant("rows_axis", _QUERY_ROWS_AXIS)], "rows", axis=0)
    past = build.node("Sub", [valid, rows], "write_indices")
    scatters = []
    for index, layer in enumerate(layers):
        for role, past_name, new_name, present in (
                ("key", layer.past_key, layer.new_key, layer.present_key),
                ("value", layer.past_value, layer.new_value, layer.present_value)):
            scatter = build.add(ir.node(value_tracing.TENSOR_SCATTER_OP,
                                        [values[past_name], values[new_name], past],
                                        {"axis": _SEQUENCE_AXIS},
                                        name=f"{build.prefix}/layer_{index}/{role}"))
            build.take_over_output(present, scatter.outputs[0])
            scatters.append(scatter.outputs[0])
    capacity = build.node("Gather", [build.node("Shape", [scatters[0]], "CacheShape"),
                                     build.constant("cache_axis", _SEQUENCE_AXIS)],
                          "capacity", axis=0)
    key_positions = build.node("Range", [zero, capacity, build.constant("step", 1)],
                               "key_positions")
    row_positions = build.node("Range", [zero, rows, build.constant("row_step", 1)],
                               "row_positions")
    # [batch, 1, rows, 1] query positions against [capacity] key positions.
    query_positions = build.node(
        "Unsqueeze", [build.node("Add", [build.node("Unsqueeze", [past, one], "past_column"),
                                         row_positions], "query_positions_2d"),
                      build.constant("query_axes", [1, 3])], "query_positions")
    attention_mask = build.node("LessOrEqual", [key_positions, query_positions], "causal")
    for index, layer in enumerate(layers):
        attention = build.add(ir.node(
            "Attention",
            [values[layer.query], scatters[2 * index], scatters[2 * index + 1], attention_mask,
             None, None, valid],
            {"scale": float(layer.scale)}, name=f"{build.prefix}/layer_{index}/Attention"))
        attention.outputs[0].name = f"{attention.name}/output_0"
        ir.convenience.replace_all_uses_with(values[layer.output], attention.outputs[0])
    build.finish(layers, value_tracing.is_tensor_scatter)
