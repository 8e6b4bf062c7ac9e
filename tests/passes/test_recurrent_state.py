import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

from onnx_chunk.graph import chunk_plan, metadata
from onnx_chunk.passes.recurrent_state import RecurrentStatePass, find_recurrent_state

CONV = ["batch_size", 16, 2]


def _state(model):
    result = RecurrentStatePass()(model)
    return result, metadata.read_recurrent_state(model).bindings


def test_plain_gqa_decoder_has_no_state(make_decoder):
    result, bindings = _state(make_decoder(layers=2))
    assert result.modified
    assert bindings == ()


def test_conv_state_found_by_name_and_structure(make_decoder):
    model = make_decoder(extra_inputs=(("past.0.conv", TensorProto.FLOAT, CONV),),
                         extra_outputs=(("present.0.conv", TensorProto.FLOAT, CONV),))
    _, bindings = _state(model)
    assert bindings == (chunk_plan.StateBinding("past.0.conv", "present.0.conv", "name+structure"),)


def test_unnamed_state_found_by_structure(make_decoder):
    model = make_decoder(extra_inputs=(("carry_in", TensorProto.FLOAT, ["batch_size", 16]),),
                         extra_outputs=(("carry_out", TensorProto.FLOAT, ["batch_size", 16]),))
    _, bindings = _state(model)
    assert bindings == (chunk_plan.StateBinding("carry_in", "carry_out", "structure"),)


def test_named_state_without_partner_found_by_name(make_decoder):
    model = make_decoder(extra_inputs=(
        ("past_key_values.0.conv_state", TensorProto.FLOAT, CONV),
        ("layers.3.recurrent_state", TensorProto.FLOAT, ["batch_size", 4, 8, 8]),
    ))
    _, bindings = _state(model)
    assert bindings == (
        chunk_plan.StateBinding("past_key_values.0.conv_state", "", "name"),
        chunk_plan.StateBinding("layers.3.recurrent_state", "", "name"),
    )


def test_type_or_shape_mismatch_is_not_state(make_decoder):
    model = make_decoder(
        extra_inputs=(("carry_in", TensorProto.FLOAT, ["batch_size", 16]),),
        extra_outputs=(("carry_out", TensorProto.FLOAT16, ["batch_size", 16]),))
    assert _state(model)[1] == ()


def test_gqa_kv_with_identical_shapes_is_never_state(make_decoder):
    same = ["batch_size", 2, "past_sequence_length", 8]
    _, bindings = _state(make_decoder(present_shape=same))
    assert bindings == ()


def test_each_output_pairs_once_and_names_break_ties(make_decoder):
    model = make_decoder(
        extra_inputs=(("past.1.conv", TensorProto.FLOAT, CONV),
                      ("past.0.conv", TensorProto.FLOAT, CONV)),
        extra_outputs=(("present.0.conv", TensorProto.FLOAT, CONV),
                       ("present.1.conv", TensorProto.FLOAT, CONV)))
    _, bindings = _state(model)
    assert [(b.input, b.output) for b in bindings] == [("past.1.conv", "present.1.conv"),
                                                      ("past.0.conv", "present.0.conv")]


def test_second_run_changes_nothing(make_decoder):
    model = make_decoder(extra_inputs=(("past.0.conv", TensorProto.FLOAT, CONV),),
                         extra_outputs=(("present.0.conv", TensorProto.FLOAT, CONV),))
    assert RecurrentStatePass()(model).modified
    assert not RecurrentStatePass()(model).modified


def _with_echo_outputs(proto, *echoed):
    """Add a graph output of each input in `echoed`, with the input's type and shape."""
    inputs = {value.name: value for value in proto.graph.input}
    for name in echoed:
        echo = onnx.ValueInfoProto()
        echo.CopyFrom(inputs[name])
        echo.name = f"{name}_out"
        proto.graph.output.append(echo)
        proto.graph.node.append(helper.make_node("Identity", [name], [echo.name]))
    return ir.serde.deserialize_model(proto)


def test_token_mask_and_per_token_ports_are_never_state(make_decoder_proto):
    proto = make_decoder_proto(position_ids="position_ids")
    model = _with_echo_outputs(proto, "input_ids", "attention_mask", "position_ids")
    _, bindings = _state(model)
    assert bindings == ()


def test_inputs_embeds_decoder_with_an_echoed_per_token_input(make_decoder_proto):
    proto = make_decoder_proto(token="inputs_embeds", extra_inputs=(
        ("row_features", TensorProto.FLOAT, ["batch_size", "sequence_length", 4]),))
    model = _with_echo_outputs(proto, "inputs_embeds", "row_features")
    assert _state(model)[1] == ()


def test_state_beside_an_echoed_token_input_is_still_found(make_decoder_proto):
    proto = make_decoder_proto(extra_inputs=(("past.0.conv", TensorProto.FLOAT, CONV),),
                               extra_outputs=(("present.0.conv", TensorProto.FLOAT, CONV),))
    model = _with_echo_outputs(proto, "input_ids")
    assert _state(model)[1] == (
        chunk_plan.StateBinding("past.0.conv", "present.0.conv", "name+structure"),)


def test_a_graph_without_a_token_input_has_no_state_by_structure():
    # c = a + b: `a` and `c` share dtype and shape, which alone proves no carried state.
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"])], "add",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [4]) for name in ("a", "b")],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [4])])
    model = ir.serde.deserialize_model(helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10))
    assert find_recurrent_state(model).bindings == ()


def test_a_named_state_input_counts_without_a_token_input():
    graph = helper.make_graph(
        [helper.make_node("Identity", ["past.0.conv"], ["present.0.conv"])], "conv",
        [helper.make_tensor_value_info("past.0.conv", TensorProto.FLOAT, [1, 8, 2])],
        [helper.make_tensor_value_info("present.0.conv", TensorProto.FLOAT, [1, 8, 2])])
    model = ir.serde.deserialize_model(helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10))
    assert [binding.input for binding in find_recurrent_state(model).bindings] == ["past.0.conv"]
