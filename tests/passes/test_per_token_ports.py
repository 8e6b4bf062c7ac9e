import onnx_ir as ir
import pytest
from onnx import TensorProto

from onnx_chunk.graph import chunk_plan, metadata
from onnx_chunk.passes.per_token_ports import PerTokenPortsPass
from onnx_chunk.passes.recurrent_state import RecurrentStatePass


def _ports(model):
    RecurrentStatePass()(model)
    result = PerTokenPortsPass()(model)
    return result, metadata.read_per_token_ports(model)


def test_refuses_to_run_before_the_recurrent_state_pass(make_decoder):
    with pytest.raises(ir.passes.PreconditionError, match="recurrent state"):
        PerTokenPortsPass()(make_decoder())


def test_recurrent_state_is_read_from_the_metadata(make_decoder):
    extra = (("row_scale", TensorProto.FLOAT, ["sequence_length"]),)
    model = make_decoder(extra_inputs=extra)
    metadata.write_recurrent_state(model, chunk_plan.RecurrentStateFindings(
        bindings=(chunk_plan.StateBinding("row_scale", "", "name"),)))
    PerTokenPortsPass()(model)
    assert metadata.read_per_token_ports(model).voids == ()


def test_input_ids_is_the_only_port_of_a_plain_decoder(make_decoder):
    result, found = _ports(make_decoder(layers=2))
    assert result.modified
    assert found == chunk_plan.PerTokenFindings("input_ids", ("input_ids",), None, ())


def test_position_ids_by_name_is_a_port_and_recorded(make_decoder):
    _, found = _ports(make_decoder(position_ids="position_ids"))
    assert found.ports == ("input_ids", "position_ids")
    assert found.position_ids == "position_ids"
    assert found.voids == ()


def test_position_ids_found_by_what_it_feeds(make_decoder):
    _, found = _ports(make_decoder(position_ids="pos", position_ids_to_gqa=True))
    assert found.ports == ("input_ids", "pos")
    assert found.position_ids == "pos"


def test_unrelated_per_token_input_is_not_position_ids(make_decoder):
    _, found = _ports(make_decoder(position_ids="segment_ids"))
    assert found.ports == ("input_ids", "segment_ids")
    assert found.position_ids is None


def test_inputs_embeds_is_the_token_input(make_decoder):
    _, found = _ports(make_decoder(token="inputs_embeds"))
    assert (found.token_input, found.ports, found.voids) == ("inputs_embeds",
                                                            ("inputs_embeds",), ())


def test_token_input_found_by_structure(make_decoder):
    _, found = _ports(make_decoder(token="tokens"))
    assert found.token_input == "tokens"
    assert found.voids == ()


def test_wider_per_token_port_counts(make_decoder):
    extra = (("row_features", TensorProto.FLOAT, ["batch_size", "sequence_length", 4]),)
    _, found = _ports(make_decoder(extra_inputs=extra))
    assert found.ports == ("input_ids", "row_features")
    assert found.voids == ()


def test_one_dimensional_port_voids_with_its_name(make_decoder):
    extra = (("row_scale", TensorProto.FLOAT, ["sequence_length"]),)
    _, found = _ports(make_decoder(extra_inputs=extra))
    assert found.ports == ("input_ids",)
    assert len(found.voids) == 1
    assert "'row_scale'" in found.voids[0] and "[sequence_length]" in found.voids[0]


def test_port_on_another_axis_name_voids(make_decoder):
    extra = (("image_features", TensorProto.FLOAT, ["batch_size", "num_patches", 16]),
             ("temperature", TensorProto.FLOAT, []))
    _, found = _ports(make_decoder(extra_inputs=extra))
    assert [void.split()[1] for void in found.voids] == ["'image_features'", "'temperature'"]


def test_state_mask_and_kv_are_not_ports_nor_voids(make_decoder):
    conv = ["batch_size", 16, 2]
    model = make_decoder(layers=2, extra_inputs=(("past.0.conv", TensorProto.FLOAT, conv),),
                         extra_outputs=(("present.0.conv", TensorProto.FLOAT, conv),))
    _, found = _ports(model)
    assert found.ports == ("input_ids",) and found.voids == ()


def test_fixed_query_axis_voids(make_decoder):
    _, found = _ports(make_decoder(query_dim=1))
    assert found.ports == ("input_ids",)
    assert "fixed or unnamed" in found.voids[0]


def test_missing_token_input_voids(make_decoder_proto):
    import onnx_ir as ir

    proto = make_decoder_proto(token="inputs_embeds")
    proto.graph.input[0].name = "hidden_in"
    proto.graph.node[0].input[0] = "hidden_in"
    _, found = _ports(ir.serde.deserialize_model(proto))
    assert found.token_input == "" and found.ports == ()
    assert "missing" in found.voids[0] and "hidden_in" in found.voids[0]


def test_second_run_changes_nothing(make_decoder):
    model = make_decoder(position_ids="position_ids")
    RecurrentStatePass()(model)
    assert PerTokenPortsPass()(model).modified
    assert not PerTokenPortsPass()(model).modified
