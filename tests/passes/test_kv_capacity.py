import onnx_ir as ir
from onnx import TensorProto

from onnx_chunk.graph import metadata
from onnx_chunk.passes.kv_capacity import CAPACITY_AXIS, KVCapacityPass, find_kv_capacity


def _run(model):
    result = KVCapacityPass()(model)
    return result, metadata.read_kv_capacity(model)


def test_binds_every_gqa_past_to_its_present(make_decoder):
    model = make_decoder(layers=3)
    result, findings = _run(model)
    assert result.modified
    assert findings.gqa_nodes == 3
    assert [(b.input, b.output) for b in findings.bindings] == [
        (f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}")
        for layer in range(3) for kind in ("key", "value")
    ]
    assert {b.capacity_axis for b in findings.bindings} == {CAPACITY_AXIS} == {2}
    assert findings.max_sequence_length == 64
    assert findings.problems == ()


def test_second_run_changes_nothing(make_decoder):
    model = make_decoder(layers=2)
    assert KVCapacityPass()(model).modified
    before = dict(model.metadata_props)
    assert not KVCapacityPass()(model).modified
    assert dict(model.metadata_props) == before


def test_follows_identity_back_and_forward(make_decoder):
    _, findings = _run(make_decoder(past_through="Identity"))
    assert [b.input for b in findings.bindings] == ["past_key_values.0.key",
                                                    "past_key_values.0.value"]
    assert findings.problems == ()


def test_follows_casts_on_both_sides(make_decoder):
    _, findings = _run(make_decoder(past_through="Cast"))
    assert [(b.input, b.output) for b in findings.bindings] == [
        ("past_key_values.0.key", "present.0.key"), ("past_key_values.0.value", "present.0.value")]
    assert findings.problems == ()


def test_past_computed_in_graph_is_a_problem_not_a_binding(make_decoder):
    _, findings = _run(make_decoder(past_through="Add"))
    assert findings.bindings == ()
    assert len(findings.problems) == 2
    assert "Add node" in findings.problems[0] and "not from a graph input" in findings.problems[0]
    assert "'attn0'" in findings.problems[0]


def test_past_from_initializer_is_a_problem(make_decoder):
    _, findings = _run(make_decoder(past_from_initializer=True))
    assert findings.bindings == ()
    assert all("an initializer" in problem for problem in findings.problems)


def test_present_shape_differing_from_past_is_a_problem(make_decoder):
    _, findings = _run(make_decoder(present_shape=["batch_size", 4, "total_sequence_length", 8]))
    assert findings.bindings == ()
    assert len(findings.problems) == 2
    assert "axis 1" in findings.problems[0]


def _fix_past_capacity(proto, rows):
    for value in proto.graph.input:
        if value.name.startswith("past_key_values."):
            dim = value.type.tensor_type.shape.dim[2]
            dim.Clear()
            dim.dim_value = rows
    return ir.serde.deserialize_model(proto)


def test_present_with_different_fixed_capacity_is_a_problem(make_decoder_proto):
    proto = make_decoder_proto(present_shape=["batch_size", 2, 128, 8])
    _, findings = _run(_fix_past_capacity(proto, 256))
    assert findings.bindings == ()
    assert "axis 2" in findings.problems[0]


def test_fixed_capacity_equal_on_both_sides_binds(make_decoder_proto):
    proto = make_decoder_proto(present_shape=["batch_size", 2, 256, 8])
    _, findings = _run(_fix_past_capacity(proto, 256))
    assert len(findings.bindings) == 2 and findings.problems == ()


def test_present_reaching_no_output_is_recorded_with_reason(make_decoder):
    _, findings = _run(make_decoder(present_unused=True))
    assert findings.bindings == ()
    assert len(findings.problems) == 2
    assert all("reaches no graph output" in problem for problem in findings.problems)


def test_model_without_gqa_has_no_bindings(make_decoder):
    model = make_decoder(gqa=False)
    result, findings = _run(model)
    assert result.modified
    assert (findings.gqa_nodes, findings.bindings, findings.max_sequence_length) == (0, (), None)


def test_find_does_not_touch_the_model(make_decoder):
    model = make_decoder()
    find_kv_capacity(model)
    assert dict(model.metadata_props) == {}


def test_wrong_rank_past_is_a_problem(make_decoder_proto):
    proto = make_decoder_proto()
    for value in proto.graph.input:
        if value.name == "past_key_values.0.key":
            del value.type.tensor_type.shape.dim[3]
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    _, findings = _run(ir.serde.deserialize_model(proto))
    assert [b.input for b in findings.bindings] == ["past_key_values.0.value"]
    assert "expected rank 4" in findings.problems[0]
