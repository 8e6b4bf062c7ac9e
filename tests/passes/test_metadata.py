import json

import onnx
import pytest

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.graph import chunk_plan, metadata
from onnx_chunk.passes import convert_model

PLAN = chunk_plan.ChunkPlan(
    schema_version=metadata.SCHEMA_VERSION,
    chunk_size=256,
    ladder=(86, 172, 256),
    max_variants=4,
    gqa_nodes=1,
    token_input="input_ids",
    per_token_ports=("input_ids", "position_ids"),
    position_ids="position_ids",
    capacity_inputs=(chunk_plan.KVBinding("past_key_values.0.key", "present.0.key", 2, 2, 16),),
    recurrent_state=(chunk_plan.StateBinding("past.1.conv", "present.1.conv", "name+structure"),),
    padding=chunk_plan.PaddingEligibility(False, (
        "recurrent state 'past.1.conv' blocks padding",
        metadata.port_void("row_scale", "is not per token"),
    )),
    max_sequence_length=2048,
    problems=("present for past_value reaches no graph output",),
)


def test_to_json_lists_names_and_full_records():
    data = json.loads(json.dumps(PLAN.to_json()))
    assert data["capacity_inputs"] == ["past_key_values.0.key"]
    assert data["kv_bindings"] == [{"input": "past_key_values.0.key", "output": "present.0.key",
                                    "capacity_axis": 2, "kv_heads": 2, "head_size": 16,
                                    "window": None}]
    assert data["recurrent_state"] == ["past.1.conv"]
    assert data["state_bindings"][0]["detected_by"] == "name+structure"
    assert data["padding"] == {"eligible": False, "reasons": list(PLAN.padding.reasons)}
    assert (data["chunk_size"], data["ladder"], data["max_variants"]) == (256, [86, 172, 256], 4)


def test_sections_round_trip(make_decoder):
    model = make_decoder()
    kv = chunk_plan.KVCapacityFindings(1, PLAN.capacity_inputs, 2048, PLAN.problems)
    state = chunk_plan.RecurrentStateFindings(PLAN.recurrent_state)
    ports = chunk_plan.PerTokenFindings("input_ids", PLAN.per_token_ports, "position_ids",
                                      (PLAN.padding.reasons[1],))
    assert metadata.write_kv_capacity(model, kv)
    assert metadata.write_recurrent_state(model, state)
    assert metadata.write_per_token_ports(model, ports)
    assert not metadata.write_kv_capacity(model, kv)
    assert metadata.read_kv_capacity(model) == kv
    assert metadata.read_recurrent_state(model) == state
    assert metadata.read_per_token_ports(model) == ports
    assert metadata.read_plan(model) is None
    assert metadata.write_declaration(model, chunk_size=256, ladder=PLAN.ladder, max_variants=4,
                                      padding=PLAN.padding)
    assert metadata.read_plan(model) == PLAN


def _converted(make_decoder):
    model = make_decoder()
    convert_model(model, chunk_size=512, max_variants=4)
    return model


def test_unconverted_model_has_no_plan(make_decoder, make_decoder_proto):
    assert metadata.read_plan(make_decoder()) is None
    assert metadata.read_plan(make_decoder_proto()) is None


def test_plain_onnx_reads_the_declaration(make_decoder, tmp_path):
    model = make_decoder()
    convert_model(model, chunk_size=512, max_variants=4)
    from onnx_chunk.graph.model_io import save_model

    save_model(model, tmp_path / "model.onnx")
    proto = onnx.load(str(tmp_path / "model.onnx"))
    props = {entry.key: entry.value for entry in proto.metadata_props}
    assert props[metadata.CHUNK_SIZE_KEY] == "512"
    assert props[metadata.LADDER_KEY] == "171,342,512"
    assert json.loads(props[metadata.KV_CAPACITY_KEY])["gqa_nodes"] == 1
    assert metadata.read_plan(proto) == metadata.read_plan(model)


def test_newer_schema_is_refused(make_decoder):
    model = _converted(make_decoder)
    model.metadata_props[metadata.SCHEMA_VERSION_KEY] = str(metadata.SCHEMA_VERSION + 1)
    with pytest.raises(ModelStructureError, match="schema version"):
        metadata.read_plan(model)


def test_damaged_section_is_refused(make_decoder):
    model = _converted(make_decoder)
    model.metadata_props[metadata.KV_CAPACITY_KEY] = "{not json"
    with pytest.raises(ModelStructureError, match="not valid JSON"):
        metadata.read_plan(model)


def test_missing_section_is_refused(make_decoder):
    model = _converted(make_decoder)
    del model.metadata_props[metadata.PADDING_KEY]
    with pytest.raises(ModelStructureError, match=metadata.PADDING_KEY):
        metadata.read_plan(model)
