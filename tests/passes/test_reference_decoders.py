"""The pipeline on the reference decoders (onnxruntime-genai layouts)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_chunk.cli import main
from onnx_chunk.graph import chunk_plan
from onnx_chunk.graph.model_io import load_model
from onnx_chunk.passes import analyze

KV = [f"past_key_values.{layer}.{kind}" for layer in range(2) for kind in ("key", "value")]


@pytest.mark.parametrize("variant", ["base", "int4", "last_token_logits"])
def test_plain_gqa_decoders_are_eligible(reference_model, variant):
    plan = analyze(load_model(reference_model(variant)), chunk_size=512)
    assert plan.gqa_nodes == 2
    assert [binding.input for binding in plan.capacity_inputs] == KV
    assert [binding.output for binding in plan.capacity_inputs] == [
        name.replace("past_key_values", "present") for name in KV]
    assert plan.per_token_ports == ("input_ids",)
    assert plan.padding == chunk_plan.PaddingEligibility(True, ())
    assert plan.max_sequence_length is not None and plan.problems == ()


def test_int4_decoder_uses_matmulnbits(reference_model):
    model = load_model(reference_model("int4"))
    assert any(node.op_type == "MatMulNBits" for node in model.graph)


def test_position_ids_decoder(reference_model):
    plan = analyze(load_model(reference_model("position_ids")))
    assert plan.per_token_ports == ("input_ids", "position_ids")
    assert plan.position_ids == "position_ids" and plan.padding.eligible


def test_inputs_embeds_decoder(reference_model):
    plan = analyze(load_model(reference_model("inputs_embeds")))
    assert (plan.token_input, plan.per_token_ports) == ("inputs_embeds", ("inputs_embeds",))
    assert plan.padding.eligible


def test_conv_hybrid_decoder_is_not_eligible(reference_model):
    model = load_model(reference_model("conv_hybrid"))
    plan = analyze(model)
    conv_inputs = [value.name for value in model.graph.inputs if value.name.endswith(".conv")]
    assert conv_inputs and [binding.input for binding in plan.recurrent_state] == conv_inputs
    assert all(binding.output == binding.input.replace("past", "present")
               for binding in plan.recurrent_state)
    assert not plan.padding.eligible
    assert len(plan.padding.reasons) == len(conv_inputs)
    assert not set(conv_inputs) & {binding.input for binding in plan.capacity_inputs}


def test_odd_port_decoder_voids_padding_naming_the_port(reference_model):
    model = load_model(reference_model("odd_port"))
    plan = analyze(model)
    odd = [value.name for value in model.graph.inputs
           if value.shape is not None and len(value.shape) == 1]
    assert len(odd) == 1
    assert not plan.padding.eligible
    assert len(plan.padding.reasons) == 1 and repr(odd[0]) in plan.padding.reasons[0]


def _logits(path, length=5):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {}
    for value in session.get_inputs():
        if value.name == "input_ids":
            feeds[value.name] = np.arange(1, length + 1, dtype=np.int64)[None]
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones((1, length), dtype=np.int64)
        elif value.name == "query_seqlens":
            feeds[value.name] = np.array([length], dtype=np.int32)
        else:
            shape = [1 if not isinstance(dim, int) and dim == "batch_size" else
                     0 if not isinstance(dim, int) else dim for dim in value.shape]
            feeds[value.name] = np.zeros(shape, dtype=np.float32)
    return session.run(["logits"], feeds)[0]


def test_converted_decoder_runs_identically(reference_model, tmp_path, capsys):
    """With --native-chunks off and --logits-rows off, convert writes metadata only: the graph
    is the original."""
    source = reference_model("int4")
    out = tmp_path / "converted" / "model.onnx"
    assert main(["convert", str(source), "-o", str(out), "--native-chunks", "off",
                 "--logits-rows", "off"]) == 0
    assert (out.parent / "genai_config.json").is_file()
    assert (out.parent / "model.onnx.data").read_bytes() == \
        (source.parent / "model.onnx.data").read_bytes()
    converted = onnx.load(str(out), load_external_data=False)
    original = onnx.load(str(source), load_external_data=False)
    for field in ("node", "input", "output", "initializer"):
        assert list(getattr(converted.graph, field)) == list(getattr(original.graph, field))
    np.testing.assert_array_equal(_logits(out), _logits(source))


def test_native_chunks_add_only_the_query_seqlens_input(reference_model, tmp_path):
    """Natively converted (the default where ONNX Runtime has the input): one graph input more,
    fed to every GroupQueryAttention, and the same logits for an unpadded call."""
    source = reference_model("int4")
    out = tmp_path / "native" / "model.onnx"
    assert main(["convert", str(source), "-o", str(out), "--logits-rows", "off"]) == 0
    converted = onnx.load(str(out), load_external_data=False).graph
    original = onnx.load(str(source), load_external_data=False).graph
    assert [value.name for value in converted.input] == \
        [value.name for value in original.input] + ["query_seqlens"]
    attention = [node for node in converted.node if node.op_type == "GroupQueryAttention"]
    assert attention and all(node.input[16] == "query_seqlens_or_all_rows" for node in attention)
    # The input is also an empty initializer (rule 5 of the pass), so callers may leave it out.
    assert [init.name for init in converted.initializer if init.name == "query_seqlens"]
    np.testing.assert_array_equal(_logits(out), _logits(source))
