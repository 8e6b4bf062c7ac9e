"""Smallest decoder-shaped graphs that show each pass rule (built with onnx.helper)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

HIDDEN = 16
VOCAB = 32
KV_HEADS = 2
HEAD = 8
COS_ROWS = 64


def _kv_shape(length: str | int) -> list:
    return ["batch_size", KV_HEADS, length, HEAD]


def _init(name: str, shape: tuple[int, ...], dtype=np.float32) -> TensorProto:
    return onnx.numpy_helper.from_array(np.zeros(shape, dtype=dtype), name)


def decoder_proto(
    *,
    layers: int = 1,
    token: str = "input_ids",
    position_ids: str | None = None,
    position_ids_to_gqa: bool = False,
    extra_inputs: tuple[tuple[str, int, list], ...] = (),
    extra_outputs: tuple[tuple[str, int, list], ...] = (),
    past_through: str | None = None,
    past_from_initializer: bool = False,
    present_unused: bool = False,
    present_shape: list | None = None,
    query_dim: str | int = "sequence_length",
    gqa: bool = True,
    opsets: dict[str, int] | None = None,
    extra_nodes: tuple[onnx.NodeProto, ...] = (),
) -> onnx.ModelProto:
    """A decoder-shaped graph: the inputs, outputs and GQA wiring the passes look at.

    It is not meant to run; only its structure matters.
    `extra_inputs`/`extra_outputs` are (name, elem_type, shape); each extra input is consumed by
    an Identity so it is a real request-fed input.
    """
    inputs = []
    nodes: list[onnx.NodeProto] = []
    inits = [_init("cos_cache", (COS_ROWS, HEAD // 2)), _init("sin_cache", (COS_ROWS, HEAD // 2)),
             _init("lm_head", (HIDDEN, VOCAB)), _init("embed", (VOCAB, HIDDEN))]
    if token == "input_ids":
        inputs.append(helper.make_tensor_value_info("input_ids", TensorProto.INT64,
                                                    ["batch_size", query_dim]))
        nodes.append(helper.make_node("Gather", ["embed", "input_ids"], ["x0"]))
    elif token == "inputs_embeds":
        inputs.append(helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT,
                                                    ["batch_size", query_dim, HIDDEN]))
        nodes.append(helper.make_node("Identity", ["inputs_embeds"], ["x0"]))
    else:
        inputs.append(helper.make_tensor_value_info(token, TensorProto.INT64,
                                                    ["batch_size", query_dim]))
        nodes.append(helper.make_node("Gather", ["embed", token], ["x0"]))
    inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                                ["batch_size", "total_sequence_length"]))
    if position_ids:
        inputs.append(helper.make_tensor_value_info(position_ids, TensorProto.INT64,
                                                    ["batch_size", query_dim]))
    nodes += [
        helper.make_node("ReduceSum", ["attention_mask"], ["mask_sum"], keepdims=0),
        helper.make_node("Cast", ["mask_sum"], ["seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["mask_shape"], start=1, end=2),
        helper.make_node("Cast", ["mask_shape"], ["total_len"], to=TensorProto.INT32),
    ]
    outputs = []
    past_type = TensorProto.FLOAT16 if past_through == "Cast" else TensorProto.FLOAT
    for layer in range(layers if gqa else 0):
        gqa_past = []
        present_names = []
        for kind in ("key", "value"):
            name = f"past_key_values.{layer}.{kind}"
            if past_from_initializer:
                inits.append(_init(name, (1, KV_HEADS, 4, HEAD)))
                gqa_past.append(name)
            else:
                inputs.append(helper.make_tensor_value_info(name, past_type,
                                                            _kv_shape("past_sequence_length")))
                if past_through == "Identity":
                    nodes.append(helper.make_node("Identity", [name], [f"{name}.id"]))
                    gqa_past.append(f"{name}.id")
                elif past_through == "Cast":
                    nodes.append(helper.make_node("Cast", [name], [f"{name}.f32"],
                                                  to=TensorProto.FLOAT))
                    gqa_past.append(f"{name}.f32")
                elif past_through == "Add":
                    nodes.append(helper.make_node("Add", [name, name], [f"{name}.sum"]))
                    gqa_past.append(f"{name}.sum")
                else:
                    gqa_past.append(name)
            present_names.append(f"present.{layer}.{kind}")
        gqa_inputs = [f"x{layer}", f"x{layer}", f"x{layer}", *gqa_past, "seqlens_k",
                      "total_len", "cos_cache", "sin_cache"]
        if position_ids_to_gqa:
            gqa_inputs.append(position_ids)
        raw_presents = [f"gqa{layer}.{kind}" for kind in ("key", "value")]
        nodes.append(helper.make_node(
            "GroupQueryAttention", gqa_inputs, [f"x{layer + 1}", *raw_presents],
            domain="com.microsoft", name=f"attn{layer}", num_heads=2, kv_num_heads=KV_HEADS,
            do_rotary=1,
        ))
        if present_unused:
            continue
        for raw, present in zip(raw_presents, present_names):
            if past_through == "Cast":
                nodes.append(helper.make_node("Cast", [raw], [present], to=TensorProto.FLOAT16))
            else:
                nodes.append(helper.make_node("Identity", [raw], [present]))
            outputs.append(helper.make_tensor_value_info(
                present, past_type, present_shape or _kv_shape("total_sequence_length")))
    last = f"x{layers if gqa else 0}"
    nodes.append(helper.make_node("MatMul", [last, "lm_head"], ["logits"]))
    outputs.insert(0, helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                    ["batch_size", query_dim, VOCAB]))
    for name, elem_type, shape in extra_inputs:
        inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        nodes.append(helper.make_node("Identity", [name], [f"{name}.used"]))
    for name, elem_type, shape in extra_outputs:
        outputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        source = name.replace("present", "past").replace("_out", "_in")
        nodes.append(helper.make_node("Identity", [f"{source}.used"], [name]))
    nodes.extend(extra_nodes)
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, initializer=inits)
    opset_map = opsets or {"": 21, "com.microsoft": 1}
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid(domain, version)
                              for domain, version in opset_map.items()], ir_version=10)


def decoder_model(**options) -> ir.Model:
    """`decoder_proto` as an onnx_ir model."""
    return ir.serde.deserialize_model(decoder_proto(**options))


@pytest.fixture
def make_decoder():
    return decoder_model


@pytest.fixture
def make_decoder_proto():
    return decoder_proto
