"""Rewrite a standard-ONNX decoder's growing (Concat) KV into GroupQueryAttention at capacity.

The layers are found by concat_kv_layers' onnxscript patterns; what both targets share (the
refusal, the copy, the builder) is concat_kv_rewrite's.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_chunk.passes import value_tracing
from onnx_chunk.passes.concat_kv_layers import ConcatKVLayer
from onnx_chunk.passes.concat_kv_rewrite import ConcatKVRewritePass, RewriteBuilder

GQA_OPSET = 1
_TO_BSNH = (0, 2, 1, 3)


class ConcatKVToGQAPass(ConcatKVRewritePass):
    """Rewrite every concat-KV attention layer into GroupQueryAttention bound at capacity.

    Rules:
    1. A layer is a match of one of two onnxscript patterns rooted at the attention's output,
       both starting at `Concat(past_key, new)` and `Concat(past_value, new)` whose pasts are
       rank-4 graph inputs and whose outputs are the graph's present outputs, each repeated
       to the query heads by Unsqueeze → Expand → Reshape (transformers' repeat_kv), a Tile,
       or nothing. Outside the match its values may be read by Shape/Size nodes only.
    2. The spelled-out form is MatMul(Q, Transpose(K, (0, 1, 3, 2))) → an optional scalar
       Mul/Div → an optional mask Add (either side) → an optional scalar Mul/Div → Softmax on
       the last axis → an optional Where(IsNaN(p), 0, p) guard → MatMul with V; Q and Kᵀ may
       each carry one Mul (either side) or Div. The constant scalar factors on Q, Kᵀ and the
       scores make the scale (a Mul or Div of Q by anything else belongs to the query). The
       opset 23 form is `Attention(Q, K, V, ...)`, which must not carry its own past (inputs
       4-6) or use its other outputs, has softcap 0, a 4D query, and without is_causal a
       mask; its scale is the attribute or 1/sqrt(head size).
    3. The mask may read `attention_mask` and shapes only (the causal padding mask transformers
       builds); a mask that reads another input's values is refused.
    4. Heads: KV heads and head size from the past input's fixed shape, query heads from the
       query's shape or its projection's weight width.
    5. Every concat-KV output must belong to a matched layer, else nothing is rewritten and the
       refusal (`requires()`) names the node where the closest match stopped: the rewrite
       happens in a copy and the model is never half rewritten. A model without concat KV
       comes back as an unchanged copy (`modified=False`).
    6. Each layer becomes one GroupQueryAttention (do_rotary=0: rotary stays as the export
       computes it, from position_ids) with Q/K/V in [batch, rows, heads*head], past
       inputs 3/4 the graph's past inputs and outputs 1/2 the graph's present outputs;
       seqlens_k = ReduceSum(attention_mask) - 1 and total_sequence_length =
       Shape(attention_mask)[1], both int32, built once for all layers as the builder does.
    7. The old mask and repeat subgraphs die and are removed; afterwards the past inputs
       may feed only GroupQueryAttention and reads of their other axes' sizes (a batch size
       taken from the past), else the rewrite is refused.
    8. `max_sequence_length` (config.json's max_position_embeddings: rotary outside GQA has no
       cos cache to size it) is recorded for the KV capacity pass.
    """

    target = "GroupQueryAttention"

    def rewrite(self, model: ir.Model, layers: tuple[ConcatKVLayer, ...]) -> None:
        _rewrite(model, layers)



def _rewrite(model: ir.Model, layers: tuple[ConcatKVLayer, ...]) -> None:
    build = RewriteBuilder(model, "/onnx_chunk/concat_kv")
    values, mask = build.values, build.mask
    model.opset_imports.setdefault(value_tracing.MICROSOFT_DOMAIN, GQA_OPSET)
    one = build.constant("one", [1])
    flat = build.constant("bsh_shape", [0, 0, -1])
    total_sum = build.node("ReduceSum", [mask, one], "ReduceSum", keepdims=0)
    seqlens = build.node("Cast", [build.node("Sub", [total_sum, one], "Sub")], "seqlens_k",
                         to=ir.DataType.INT32)
    width = build.node("Gather", [build.node("Shape", [mask], "Shape"),
                                  build.constant("mask_axis", 1)], "Gather", axis=0)
    total = build.node("Cast", [width], "total_sequence_length", to=ir.DataType.INT32)
    seqlens.dtype = total.dtype = ir.DataType.INT32
    for index, layer in enumerate(layers):
        scope = f"layer_{index}"
        packed = [build.node("Reshape", [build.node("Transpose", [values[name]],
                                                    f"{scope}/{role}/Transpose",
                                                    perm=list(_TO_BSNH)), flat],
                             f"{scope}/{role}/Reshape")
                  for role, name in (("q", layer.query), ("k", layer.new_key),
                                     ("v", layer.new_value))]
        gqa = build.add(ir.node(
            "GroupQueryAttention",
            [*packed, values[layer.past_key], values[layer.past_value], seqlens, total],
            {"num_heads": layer.num_heads, "kv_num_heads": layer.kv_num_heads,
             "scale": float(layer.scale), "do_rotary": 0},
            domain=value_tracing.MICROSOFT_DOMAIN, num_outputs=3,
            name=f"{build.prefix}/{scope}/GroupQueryAttention"))
        attended, present_key, present_value = gqa.outputs
        attended.name = f"{gqa.name}/output_0"
        build.take_over_output(layer.present_key, present_key)
        build.take_over_output(layer.present_value, present_value)
        heads = build.constant(f"{scope}/bsnh_shape", [0, 0, layer.num_heads, layer.head_size])
        old = values[layer.output]
        consumers = old.consumers()
        transpose = consumers[0] if len(consumers) == 1 else None
        if (transpose is not None and transpose.op_type == "Transpose"
                and tuple(transpose.attributes["perm"].as_ints()) == _TO_BSNH):
            ir.convenience.replace_all_uses_with(
                transpose.outputs[0], build.node("Reshape", [attended, heads], f"{scope}/bsnh"))
        else:
            bsnh = build.node("Reshape", [attended, heads], f"{scope}/bsnh")
            ir.convenience.replace_all_uses_with(
                old, build.node("Transpose", [bsnh], f"{scope}/bnsh", perm=list(_TO_BSNH)))
    build.finish(layers, value_tracing.is_gqa)

