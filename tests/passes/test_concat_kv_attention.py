"""The concat-KV rewrite on the real Optimum and torch.onnx exports, and what it refuses."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from onnx_chunk.cli import main
from onnx_chunk.errors import ModelStructureError
from onnx_chunk.graph import metadata
from onnx_chunk.passes import value_tracing
from onnx_chunk.passes.concat_kv_attention import ConcatKVToGQAPass
from onnx_chunk.passes.concat_kv_layers import (
    FORM_ATTENTION,
    FORM_SOFTMAX,
    find_concat_kv_attention,
)
from onnx_chunk.passes.concat_kv_rewrite import reads_sequence_axis
from onnx_chunk.passes.kv_capacity import find_kv_capacity
from tests.exports.corpus import GENAI, fixtures
from tests.passes.export_graphs import insert_after, load_export

STANDARD = [fixture for fixture in fixtures() if fixture.layout != GENAI]
OPTIMUM = "optimum-llama-fp32"
TORCH = "torch-llama-opset23"


def _node(model: ir.Model, name: str) -> ir.Node:
    return next(node for node in model.graph if node.name == name)


@pytest.mark.parametrize("fixture", STANDARD, ids=str)
def test_finds_every_layer_of_each_standard_export(fixture):
    findings = find_concat_kv_attention(ir.load(fixture.folder / "model.onnx").graph)
    assert findings.refusal is None
    form = FORM_ATTENTION if fixture.layout == "torch_onnx" else FORM_SOFTMAX
    assert [(layer.past_key, layer.present_value, layer.form) for layer in findings.layers] == [
        (f"past_key_values.{index}.key", f"present.{index}.value", form) for index in range(2)]
    assert {(layer.num_heads, layer.kv_num_heads, layer.head_size, layer.scale)
            for layer in findings.layers} == {(4, 2, 16, 0.25)}
    op = "Attention" if form == FORM_ATTENTION else "Softmax"
    graph = {node.name: node.op_type for node in ir.load(fixture.folder / "model.onnx").graph}
    assert {graph[layer.anchor] for layer in findings.layers} == {op}


@pytest.mark.parametrize("fixture", STANDARD, ids=str)
def test_rewrites_each_layer_into_gqa_sharing_past_and_present(fixture):
    model = ir.load(fixture.folder / "model.onnx")
    result = ConcatKVToGQAPass(max_sequence_length=2048)(model)
    assert result.modified and result.model is not model
    graph = result.model.graph
    nodes = value_tracing.gqa_nodes(graph)
    inputs = {value.name: value for value in graph.inputs}
    outputs = {value.name: value for value in graph.outputs}
    assert len(nodes) == 2
    for index, node in enumerate(nodes):
        assert node.inputs[3] is inputs[f"past_key_values.{index}.key"]
        assert node.inputs[4] is inputs[f"past_key_values.{index}.value"]
        assert node.outputs[1] is outputs[f"present.{index}.key"]
        assert node.outputs[2] is outputs[f"present.{index}.value"]
        assert node.attributes["do_rotary"].as_int() == 0
        assert node.inputs[5] is nodes[0].inputs[5] and node.inputs[6] is nodes[0].inputs[6]
        assert node.inputs[5].dtype == node.inputs[6].dtype == ir.DataType.INT32
        for past in node.inputs[3:5]:
            assert [consumer.op_type for consumer in past.consumers()
                    if consumer.op_type != "Shape"] == ["GroupQueryAttention"]
    ops = {node.op_type for node in graph}
    assert not ops & {"Softmax", "Attention", "IsNaN", "LessOrEqual"}
    assert "ReduceSum" in {node.op_type for node in inputs["attention_mask"].consumers()}
    assert inputs["position_ids"].consumers()
    assert find_concat_kv_attention(model.graph).layers, "the input model was changed"
    assert find_kv_capacity(result.model).max_sequence_length == 2048


def test_second_run_and_a_builder_export_change_nothing():
    rewritten = ConcatKVToGQAPass()(load_export(OPTIMUM)).model
    assert metadata.read_max_positions(rewritten) is None
    assert not ConcatKVToGQAPass()(rewritten).modified
    builder = load_export("genai-llama-fp32")
    assert not find_concat_kv_attention(builder.graph).concat_kv
    assert not ConcatKVToGQAPass()(builder).modified


def test_a_softcap_before_softmax_is_refused_naming_the_node():
    model = load_export(OPTIMUM)
    name = insert_after(model, "/model/layers.1/self_attn/MatMul", "Tanh")
    findings = find_concat_kv_attention(model.graph)
    assert not findings.layers and f"Tanh node {name!r}" in findings.refusal
    count = len(model.graph)
    with pytest.raises(ModelStructureError, match="nothing was rewritten") as refused:
        ConcatKVToGQAPass()(model)
    assert isinstance(refused.value, ir.passes.PreconditionError)  # requires() refused it
    assert len(model.graph) == count


def test_a_query_scaled_by_a_computed_factor_keeps_the_product_as_the_query():
    model = load_export(OPTIMUM)
    scale = _node(model, "/model/layers.0/self_attn/Mul_8")
    computed = ir.node("Identity", [scale.inputs[1]], name="computed_factor")
    model.graph.insert_before(scale, computed)
    scale.replace_input_with(1, computed.outputs[0])
    first, second = find_concat_kv_attention(model.graph).layers
    assert (first.query, first.scale) == (scale.outputs[0].name, 0.5)
    assert (second.query, second.scale) == ("/model/layers.1/self_attn/Add_output_0", 0.25)


def test_a_scale_on_either_side_of_the_key_mul_is_matched():
    model = load_export(OPTIMUM)
    scale = _node(model, "/model/layers.1/self_attn/Mul_9")
    key, factor = scale.inputs
    scale.replace_input_with(0, factor)
    scale.replace_input_with(1, key)
    findings = find_concat_kv_attention(model.graph)
    assert findings.refusal is None
    assert [layer.scale for layer in findings.layers] == [0.25, 0.25]


def test_a_scale_after_the_mask_add_joins_the_scale():
    model = load_export(OPTIMUM)
    softmax = _node(model, "/model/layers.0/self_attn/Softmax")
    two = ir.node("Constant", [], {"value": ir.tensor(2.0)}, name="two")
    doubled = ir.node("Mul", [softmax.inputs[0], two.outputs[0]], name="doubled")
    model.graph.insert_before(softmax, [two, doubled])
    softmax.replace_input_with(0, doubled.outputs[0])
    assert [layer.scale for layer in find_concat_kv_attention(model.graph).layers] == [0.5, 0.25]


def test_a_second_reader_of_the_attention_weights_is_refused_naming_it():
    model = load_export(OPTIMUM)
    softmax = _node(model, "/model/layers.0/self_attn/Softmax")
    reader = ir.node("Neg", [softmax.outputs[0]], name="weights_reader")
    model.graph.insert_after(softmax, reader)
    findings = find_concat_kv_attention(model.graph)
    assert not findings.layers and "Neg node 'weights_reader'" in findings.refusal


def test_attention_with_a_softcap_or_own_past_is_refused():
    model = load_export(TORCH)
    node = _node(model, "node_scaled_dot_product_attention_1")
    node.attributes["softcap"] = ir.AttrFloat32("softcap", 30.0)
    assert "softcap 30" in find_concat_kv_attention(model.graph).refusal
    model = load_export(TORCH)
    node = _node(model, "node_scaled_dot_product_attention")
    past = model.graph.inputs[3]
    node.resize_inputs(5)
    node.replace_input_with(4, past)
    assert "carries its own KV cache" in find_concat_kv_attention(model.graph).refusal


def test_a_mask_that_reads_position_ids_is_refused():
    model = load_export(TORCH)
    node = _node(model, "node_scaled_dot_product_attention")
    positions = next(value for value in model.graph.inputs if value.name == "position_ids")
    mixed = ir.node("Add", [node.inputs[3], positions], name="mask_with_positions")
    model.graph.insert_before(node, mixed)
    node.replace_input_with(3, mixed.outputs[0])
    assert "reads the values of input 'position_ids'" in \
        find_concat_kv_attention(model.graph).refusal


def test_shape_reads_of_the_past_that_miss_its_sequence_axis_stay_allowed():
    past = ir.Value(name="past", shape=ir.Shape([1, 2, "past", 16]))
    assert not reads_sequence_axis(ir.node("Shape", [past], {"start": 0, "end": 1}))
    assert reads_sequence_axis(ir.node("Shape", [past], {"start": 2, "end": 3}))
    assert reads_sequence_axis(ir.node("Shape", [past], {"start": -2}))
    assert reads_sequence_axis(ir.node("Transpose", [past]))
    for index, reads in ((0, False), (3, False), (2, True), (-2, True)):
        whole = ir.node("Shape", [past])
        ir.node("Gather", [whole.outputs[0], ir.Value(name="i", const_value=ir.tensor(index))])
        assert reads_sequence_axis(whole) is reads, index


def test_convert_refuses_an_unrecognised_layer_in_one_line_and_inspect_says_why(
        tmp_path, capsys):
    model = load_export(OPTIMUM)
    name = insert_after(model, "/model/layers.0/self_attn/MatMul", "Tanh")
    ir.save(model, tmp_path / "model.onnx")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "model.onnx"), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and name in err
    assert not (tmp_path / "out").exists()
    assert main(["inspect", str(tmp_path / "model.onnx")]) == 0
    assert f"concat KV: not rewritable: Tanh node {name!r}" in capsys.readouterr().out


def test_a_malformed_max_positions_key_is_a_typed_error():
    assert metadata.read_max_positions({metadata.MAX_POSITIONS_KEY: "2048"}) == 2048
    for text in ("0", "-5", "many"):
        with pytest.raises(ModelStructureError, match="positive integer"):
            metadata.read_max_positions({metadata.MAX_POSITIONS_KEY: text})
