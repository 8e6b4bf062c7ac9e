import json

import numpy as np
import onnx
import pytest

from onnx_chunk.errors import OutputError
from onnx_chunk.models import VARIANTS, build_decoder
from onnx_chunk.models.reference import ReferenceDecoder

from ._ort import session


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_passes_the_checker_and_loads_in_ort(reference_model, variant):
    path = reference_model(variant)
    onnx.checker.check_model(str(path), full_check=True)
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        ["model.onnx", "model.onnx.data", "genai_config.json"]
        + (["embeddings.npy"] if variant == "inputs_embeds" else []))
    sess = session(path)
    inputs = {i.name: i for i in sess.get_inputs()}
    outputs = {o.name: o for o in sess.get_outputs()}
    assert inputs["attention_mask"].shape == ["batch_size", "total_sequence_length"]
    assert outputs["logits"].shape[0] == "batch_size"
    assert outputs["logits"].shape[2] == 256


def test_base_io_matches_the_genai_builder_contract(reference_model):
    path = reference_model("base")
    sess = session(path)
    inputs = {i.name: (i.type, i.shape) for i in sess.get_inputs()}
    outputs = {o.name: (o.type, o.shape) for o in sess.get_outputs()}
    assert list(inputs) == ["input_ids", "attention_mask", "past_key_values.0.key",
                            "past_key_values.0.value", "past_key_values.1.key",
                            "past_key_values.1.value"]
    assert inputs["input_ids"] == ("tensor(int64)", ["batch_size", "sequence_length"])
    assert inputs["past_key_values.1.value"] == (
        "tensor(float)", ["batch_size", 2, "past_sequence_length", 16])
    assert outputs["logits"] == ("tensor(float)", ["batch_size", "sequence_length", 256])
    assert outputs["present.0.key"] == (
        "tensor(float)", ["batch_size", 2, "total_sequence_length", 16])
    model = onnx.load(str(path), load_external_data=False)
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    assert ops.count(("com.microsoft", "GroupQueryAttention")) == 2
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gqa.attribute}
    assert (attrs["num_heads"], attrs["kv_num_heads"], attrs["do_rotary"],
            attrs["rotary_interleaved"]) == (4, 2, 1, 0)
    assert attrs["scale"] == pytest.approx(0.25)
    mask = "/model/attn_mask_reformat/attn_mask_subgraph"
    assert list(gqa.input[3:9]) == ["past_key_values.0.key", "past_key_values.0.value",
                                   f"{mask}/Sub/Cast/output_0", f"{mask}/Gather/Cast/output_0",
                                   "cos_cache", "sin_cache"]
    producers = {out: n for n in model.graph.node for out in n.output}
    seqlens = producers[gqa.input[5]]
    assert seqlens.op_type == "Cast"
    assert producers[seqlens.input[0]].op_type == "Sub"
    reduce = producers[producers[seqlens.input[0]].input[0]]
    assert (reduce.op_type, reduce.input[0]) == ("ReduceSum", "attention_mask")
    total = producers[gqa.input[6]]
    assert producers[producers[total.input[0]].input[0]].op_type == "Shape"
    caches = {i.name: list(i.dims) for i in model.graph.initializer if "cache" in i.name}
    assert caches == {"cos_cache": [2048, 8], "sin_cache": [2048, 8]}
    external = [i for i in model.graph.initializer
                if i.data_location == onnx.TensorProto.EXTERNAL]
    assert {i.name for i in external} >= {"model.embed_tokens.weight", "lm_head.MatMul.weight"}


def test_genai_config_describes_the_folder(reference_model):
    config = json.loads((reference_model("base").parent / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert decoder["filename"] == "model.onnx"
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"],
            decoder["hidden_size"], decoder["num_attention_heads"]) == (2, 2, 16, 64, 4)
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert decoder["outputs"]["present_value_names"] == "present.%d.value"
    assert config["model"]["context_length"] == 2048
    assert config["model"]["vocab_size"] == 256
    assert config["search"]["max_length"] == 2048
    conv = json.loads((reference_model("conv_hybrid").parent / "genai_config.json").read_text())
    assert conv["model"]["decoder"]["inputs"]["past_conv_names"] == "past.%d.conv"
    assert conv["model"]["decoder"]["layer_types"] == ["conv", "full_attention"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_same_seed_gives_identical_bytes(tmp_path, variant):
    first = build_decoder(tmp_path / "a", variant=variant, seed=7)
    second = build_decoder(tmp_path / "b", variant=variant, seed=7)
    other = build_decoder(tmp_path / "c", variant=variant, seed=8)
    names = sorted(p.name for p in first.parent.iterdir())
    assert names == sorted(p.name for p in second.parent.iterdir())
    assert {"model.onnx", "model.onnx.data", "genai_config.json"} <= set(names)
    assert ("embeddings.npy" in names) == (variant == "inputs_embeds")
    for name in names:
        assert (first.parent / name).read_bytes() == (second.parent / name).read_bytes()
    assert ((first.parent / "model.onnx.data").read_bytes()
            != (other.parent / "model.onnx.data").read_bytes())


def test_rebuild_replaces_files_and_leaves_no_staging(tmp_path):
    build_decoder(tmp_path, seed=1)
    build_decoder(tmp_path, seed=2, num_layers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "genai_config.json", "model.onnx", "model.onnx.data"]
    assert ReferenceDecoder.from_model_dir(tmp_path).config.num_layers == 1


def test_unwritable_output_raises_output_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OutputError, match="writable"):
        build_decoder(blocker / "model")


def test_int4_uses_matmul_nbits_block_32(reference_model):
    model = onnx.load(str(reference_model("int4")), load_external_data=False)
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 * 7 + 1
    assert not [n for n in model.graph.node if n.op_type == "MatMul"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nbits[0].attribute}
    assert (attrs["bits"], attrs["block_size"]) == (4, 32)


def test_inputs_embeds_writes_the_embedding_table(reference_model):
    path = reference_model("inputs_embeds")
    table = np.load(path.parent / "embeddings.npy")
    assert table.shape == (256, 64) and table.dtype == np.float32
    base = ReferenceDecoder.from_model_dir(reference_model("base"))
    assert np.array_equal(table, base.embedding)
