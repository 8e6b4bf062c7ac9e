import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from onnx_chunk.errors import ConfigError, ModelStructureError
from onnx_chunk.graph import metadata
from onnx_chunk.passes import DecoderPipeline, LogitsRowsPass, analyze, convert_model
from onnx_chunk.passes.pipeline import annotation_passes


def test_convert_then_convert_again_changes_nothing(make_decoder):
    model = make_decoder(layers=2, position_ids="position_ids")
    assert convert_model(model, chunk_size=512, max_variants=4).modified
    before = dict(model.metadata_props)
    assert not convert_model(model, chunk_size=512, max_variants=4).modified
    assert dict(model.metadata_props) == before
    assert convert_model(model, chunk_size=128, max_variants=4).modified


def test_analyze_leaves_the_model_untouched(make_decoder):
    model = make_decoder(layers=2)
    plan = analyze(model)
    assert dict(model.metadata_props) == {}
    assert (plan.chunk_size, plan.ladder, plan.max_variants) == (None, (), 4)
    assert plan.gqa_nodes == 2 and len(plan.capacity_inputs) == 4
    assert plan.padding.eligible


def test_analyze_of_a_converted_model_keeps_its_chunk_size(make_decoder):
    model = make_decoder()
    convert_model(model, chunk_size=300, max_variants=4)
    assert analyze(model).chunk_size == 300
    assert analyze(model, chunk_size=64).ladder == (22, 44, 64)
    assert metadata.read_plan(model).chunk_size == 300


def test_convert_refuses_a_model_without_gqa(make_decoder):
    model = make_decoder(gqa=False)
    with pytest.raises(ModelStructureError, match="KV capacity annotation does not apply"):
        convert_model(model)
    assert dict(model.metadata_props) == {}
    plan = analyze(model)
    assert plan.gqa_nodes == 0 and not plan.padding.eligible


@pytest.mark.parametrize("opsets,match", [
    ({"": 5, "com.microsoft": 1}, "opset 5"),
    ({"": 21, "com.microsoft": 2}, "com.microsoft"),
])
def test_unsupported_opsets_are_refused(make_decoder, opsets, match):
    with pytest.raises(ModelStructureError, match=match) as refused:
        convert_model(make_decoder(opsets=opsets))
    assert isinstance(refused.value, ir.passes.PreconditionError)  # the pipeline's requires()


def test_a_model_without_a_kv_cache_is_refused_before_any_pass_runs(make_decoder):
    model = make_decoder(gqa=False)
    passes = [LogitsRowsPass("on"), *annotation_passes(512, 4)]
    with pytest.raises(ModelStructureError, match="annotation does not apply") as refused:
        DecoderPipeline(*passes, require_kv_cache=True)(model)
    assert isinstance(refused.value, ir.passes.PreconditionError)
    assert [value.name for value in model.graph.inputs] == ["input_ids", "attention_mask"]
    assert dict(model.metadata_props) == {}
    # Analysis asks for no KV cache: the same passes run, wire the input and plan no padding.
    assert DecoderPipeline(*passes)(model).modified
    assert metadata.read_logits_rows(model) == "logits_rows"
    assert not metadata.read_plan(model).padding.eligible


def test_a_typed_error_of_a_pass_reaches_the_caller_unwrapped(make_decoder):
    # Sequential wraps what a pass raises in onnx_ir's PassError; the pipeline unwraps ours.
    with pytest.raises(ConfigError, match="--logits-rows on: .*must be the query axis"):
        convert_model(make_decoder(query_dim=5), logits_rows="on")


def test_unknown_domain_is_refused(make_decoder):
    odd = helper.make_node("Frobnicate", ["logits"], ["odd"], domain="com.example")
    model = make_decoder(opsets={"": 21, "com.microsoft": 1, "com.example": 1},
                         extra_nodes=(odd,))
    with pytest.raises(ModelStructureError, match="'com.example'"):
        analyze(model)


def test_conv_state_and_odd_port_make_padding_ineligible(make_decoder):
    conv = ["batch_size", 16, 2]
    model = make_decoder(extra_inputs=(("past.0.conv", TensorProto.FLOAT, conv),),
                         extra_outputs=(("present.0.conv", TensorProto.FLOAT, conv),))
    plan = analyze(model, chunk_size=512)
    assert [binding.input for binding in plan.recurrent_state] == ["past.0.conv"]
    assert not plan.padding.eligible and len(plan.padding.reasons) == 1
