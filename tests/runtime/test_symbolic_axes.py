"""KV axes that builder exports declare symbolic are sized from the graph, never a constant."""

from __future__ import annotations

import dataclasses
import json

import onnx
import pytest

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.graph.model_file import read_model_file
from onnx_chunk.graph.model_io import load_model
from onnx_chunk.models.reference import ReferenceDecoder
from onnx_chunk.passes import analyze
from onnx_chunk.runtime import load
from onnx_chunk.runtime.state.ports import model_ports
from tests.validate.mutations import copy_model, edit_graph

HEAD_AXIS = 3


def _symbolic_head_axis(proto: onnx.ModelProto) -> None:
    """Declare axis 3 of every past and present `kv_cache_dim`, as onnxruntime-genai's builder."""
    for value in (*proto.graph.input, *proto.graph.output):
        if value.name.startswith(("past_key_values.", "present.")):
            dim = value.type.tensor_type.shape.dim[HEAD_AXIS]
            dim.Clear()
            dim.dim_param = "kv_cache_dim"


@pytest.fixture(params=["base", "int4"])
def builder_axes_model(request, reference_model, tmp_path):
    model = copy_model(reference_model(request.param), tmp_path / "model")
    edit_graph(model, _symbolic_head_axis)
    return model


def test_a_symbolic_head_axis_is_sized_from_the_k_projection(builder_axes_model):
    plan = analyze(load_model(builder_axes_model))
    config = json.loads((builder_axes_model.parent / "genai_config.json").read_text())
    head_size = config["model"]["decoder"]["head_size"]
    kv_heads = config["model"]["decoder"]["num_key_value_heads"]
    assert {(binding.kv_heads, binding.head_size) for binding in plan.capacity_inputs} == {
        (kv_heads, head_size)}


def test_a_decoder_with_a_symbolic_head_axis_generates_the_reference_tokens(builder_axes_model):
    runtime = load(builder_axes_model, provider="cpu", chunk_size=16, capacity=128)
    assert {port.shape[HEAD_AXIS] for port in runtime.debug.ports.kv} == {
        ReferenceDecoder.from_model_dir(builder_axes_model.parent).config.head_size}
    prompt = list(range(3, 40))
    tokens = runtime.open_sequence().generate(prompt, 6)
    assert tokens == ReferenceDecoder.from_model_dir(builder_axes_model.parent).greedy(prompt, 6)


def test_an_axis_the_graph_leaves_free_takes_genai_head_size_or_is_named(builder_axes_model):
    model = read_model_file(builder_axes_model)
    plan = analyze(load_model(builder_axes_model))
    blind = dataclasses.replace(plan, capacity_inputs=tuple(
        dataclasses.replace(binding, head_size=None) for binding in plan.capacity_inputs))
    with pytest.raises(ModelStructureError, match="'kv_cache_dim' at axis 3.*head_size"):
        model_ports(model, blind, 64)
    head_size = plan.capacity_inputs[0].head_size
    ports = model_ports(model, blind, 64, head_size=head_size)
    assert {port.shape for port in ports.kv} == {port.shape for port in
                                                 model_ports(model, plan, 64).kv}
    assert ports.fixed_dims["kv_cache_dim"] == head_size
