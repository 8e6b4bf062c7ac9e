import onnx_ir as ir
import pytest
from onnx import TensorProto

from onnx_chunk.errors import ConfigError
from onnx_chunk.graph import chunk_plan, metadata
from onnx_chunk.ladder import ladder_tiers
from onnx_chunk.passes import (
    ChunkedPrefillDeclarationPass,
    KVCapacityPass,
    PerTokenPortsPass,
    RecurrentStatePass,
)


def _analysed(model):
    for pass_ in (KVCapacityPass(), RecurrentStatePass(), PerTokenPortsPass()):
        pass_(model)
    return model


def test_declares_chunk_size_ladder_cap_and_schema(make_decoder):
    model = _analysed(make_decoder())
    assert ChunkedPrefillDeclarationPass(chunk_size=512, max_variants=4)(model).modified
    props = model.metadata_props
    assert props[metadata.CHUNK_SIZE_KEY] == "512"
    assert props[metadata.LADDER_KEY] == "171,342,512"
    assert props[metadata.MAX_VARIANTS_KEY] == "4"
    assert props[metadata.SCHEMA_VERSION_KEY] == str(metadata.SCHEMA_VERSION)
    plan = metadata.read_plan(model)
    assert plan.padding == chunk_plan.PaddingEligibility(True, ())


@pytest.mark.parametrize("chunk_size,max_variants", [(512, 4), (300, 3), (64, 8), (5, 10)])
def test_ladder_is_the_shared_ladder(make_decoder, chunk_size, max_variants):
    model = _analysed(make_decoder())
    ChunkedPrefillDeclarationPass(chunk_size=chunk_size, max_variants=max_variants)(model)
    plan = metadata.read_plan(model)
    assert plan.ladder == ladder_tiers(chunk_size, max_variants)
    assert plan.ladder[-1] == chunk_size


def test_idempotent_until_a_setting_changes(make_decoder):
    model = _analysed(make_decoder())
    assert ChunkedPrefillDeclarationPass(512, 4)(model).modified
    assert not ChunkedPrefillDeclarationPass(512, 4)(model).modified
    assert ChunkedPrefillDeclarationPass(256, 4)(model).modified
    assert metadata.read_plan(model).ladder == (86, 172, 256)
    assert ChunkedPrefillDeclarationPass(256, 5)(model).modified
    assert not ChunkedPrefillDeclarationPass(None, 5)(model).modified
    assert metadata.read_plan(model).chunk_size == 256


def test_no_chunk_size_on_an_unconverted_model_declares_none(make_decoder):
    model = _analysed(make_decoder())
    ChunkedPrefillDeclarationPass(chunk_size=None)(model)
    plan = metadata.read_plan(model)
    assert (plan.chunk_size, plan.ladder) == (None, ())
    assert metadata.CHUNK_SIZE_KEY not in model.metadata_props


def test_padding_reasons_collect_every_finding(make_decoder):
    conv = ["batch_size", 16, 2]
    model = _analysed(make_decoder(
        past_through="Add",
        extra_inputs=(("past.0.conv", TensorProto.FLOAT, conv),
                      ("row_scale", TensorProto.FLOAT, ["sequence_length"])),
        extra_outputs=(("present.0.conv", TensorProto.FLOAT, conv),)))
    ChunkedPrefillDeclarationPass()(model)
    reasons = metadata.read_plan(model).padding.reasons
    # Two unbound pasts; their inputs, no longer GQA KV, void like any request-fed input.
    assert len(reasons) == 6
    assert sum("not from a graph input" in reason for reason in reasons) == 2
    assert sum(reason.startswith("recurrent state 'past.0.conv'") for reason in reasons) == 1
    assert sorted(reason.split()[1] for reason in reasons if reason.startswith("input ")) == [
        "'past_key_values.0.key'", "'past_key_values.0.value'", "'row_scale'"]


def test_no_gqa_is_a_padding_reason(make_decoder):
    model = _analysed(make_decoder(gqa=False))
    ChunkedPrefillDeclarationPass()(model)
    padding = metadata.read_plan(model).padding
    assert not padding.eligible
    assert "no com.microsoft::GroupQueryAttention" in padding.reasons[0]


@pytest.mark.parametrize("missing,key", [("kv capacity", metadata.KV_CAPACITY_KEY),
                                         ("recurrent state", metadata.RECURRENT_STATE_KEY),
                                         ("per-token ports", metadata.PER_TOKEN_PORTS_KEY)])
def test_refuses_to_run_without_each_analysis_pass(make_decoder, missing, key):
    model = _analysed(make_decoder())
    del model.metadata_props[key]
    with pytest.raises(ir.passes.PreconditionError, match=f"findings of the {missing} pass"):
        ChunkedPrefillDeclarationPass()(model)
    assert metadata.CHUNK_SIZE_KEY not in model.metadata_props


@pytest.mark.parametrize("chunk_size,max_variants", [(0, 4), (512, 1)])
def test_impossible_settings_are_config_errors(chunk_size, max_variants):
    with pytest.raises(ConfigError):
        ChunkedPrefillDeclarationPass(chunk_size=chunk_size, max_variants=max_variants)


def test_damaged_declared_chunk_size_is_refused(make_decoder):
    from onnx_chunk.errors import ModelStructureError

    model = _analysed(make_decoder())
    model.metadata_props[metadata.CHUNK_SIZE_KEY] = "lots"
    with pytest.raises(ModelStructureError, match="'lots'") as refused:
        ChunkedPrefillDeclarationPass(chunk_size=None)(model)
    assert isinstance(refused.value, ir.passes.PreconditionError)  # requires() refused it
    assert ChunkedPrefillDeclarationPass(chunk_size=128)(model).modified
