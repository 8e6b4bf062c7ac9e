"""The opset 24 target of the concat-KV rewrite (TensorScatter + Attention) on the real exports."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from onnx_chunk.errors import ConfigError, ModelStructureError
from onnx_chunk.passes import convert_model, value_tracing
from onnx_chunk.passes.concat_kv_tensor_scatter import (
    IR_VERSION,
    OPSET,
    ConcatKVToTensorScatterPass,
)
from onnx_chunk.passes.kv_capacity import find_kv_capacity, kv_past_inputs, kv_present_outputs
from onnx_chunk.passes.recurrent_state import find_recurrent_state
from tests.exports.corpus import GENAI, fixtures
from tests.passes.export_graphs import insert_after, load_export

STANDARD = [fixture for fixture in fixtures() if fixture.layout != GENAI]


@pytest.mark.parametrize("fixture", STANDARD, ids=str)
def test_each_layer_writes_its_kv_in_place_and_attends_at_capacity(fixture):
    model = ir.load(fixture.folder / "model.onnx")
    result = ConcatKVToTensorScatterPass(max_sequence_length=2048)(model)
    assert result.modified and result.model is not model
    rewritten = result.model
    graph = rewritten.graph
    assert rewritten.opset_imports[""] == OPSET and rewritten.ir_version >= IR_VERSION
    inputs = {value.name: value for value in graph.inputs}
    outputs = {value.name: value for value in graph.outputs}
    scatters = value_tracing.tensor_scatter_nodes(graph)
    assert [(node.inputs[0].name, node.outputs[0].name) for node in scatters] == [
        (f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}")
        for layer in range(2) for kind in ("key", "value")]
    for node in scatters:
        assert node.inputs[0] is inputs[node.inputs[0].name]
        assert node.outputs[0] is outputs[node.outputs[0].name]
        assert node.inputs[2] is scatters[0].inputs[2]
    attention = [node for node in graph if node.op_type == "Attention"]
    assert len(attention) == 2 and not value_tracing.gqa_nodes(graph)
    for index, node in enumerate(attention):
        assert node.inputs[1] is scatters[2 * index].outputs[0]
        assert node.inputs[2] is scatters[2 * index + 1].outputs[0]
        assert node.inputs[3].producer().op_type == "LessOrEqual"
        assert node.inputs[6] is attention[0].inputs[6]
        assert node.attributes["scale"].as_float() == 0.25
    assert not {node.op_type for node in graph} & {"Softmax", "IsNaN", "GroupQueryAttention"}
    kv = find_kv_capacity(rewritten)
    assert [(binding.input, binding.output, binding.kv_heads, binding.head_size)
            for binding in kv.bindings] == [
        (f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}", 2, 16)
        for layer in range(2) for kind in ("key", "value")]
    assert kv.max_sequence_length == 2048 and kv.problems == () and kv.gqa_nodes == 0
    assert kv_past_inputs(graph) == {binding.input for binding in kv.bindings}
    assert kv_present_outputs(graph) == {binding.output for binding in kv.bindings}
    assert find_recurrent_state(rewritten).bindings == ()


def test_second_run_changes_nothing_and_a_refused_layer_rewrites_nothing():
    rewritten = ConcatKVToTensorScatterPass()(load_export("torch-llama-opset23")).model
    assert not ConcatKVToTensorScatterPass()(rewritten).modified
    model = load_export("optimum-llama-fp32")
    insert_after(model, "/model/layers.1/self_attn/MatMul", "Tanh")
    count = len(model.graph)
    with pytest.raises(ModelStructureError, match="Tanh node") as refused:
        ConcatKVToTensorScatterPass()(model)
    assert isinstance(refused.value, ir.passes.PreconditionError)  # requires() refused it
    assert len(model.graph) == count and model.opset_imports[""] == 18


def test_an_unknown_kv_cache_target_is_a_config_error():
    with pytest.raises(ConfigError, match="onnx24"):
        convert_model(load_export("optimum-llama-fp32"), kv_cache="tensorrt")
