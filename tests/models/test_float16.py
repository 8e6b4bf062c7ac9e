"""float16 reference decoders (the CUDA layout): graph types, parity in ORT's CPU provider."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from onnx_chunk.cli import main
from onnx_chunk.errors import ConfigError
from onnx_chunk.models import VARIANTS, build_decoder
from onnx_chunk.models.reference import ReferenceDecoder

from ._ort import carry, empty_state_feeds, request_feeds, run, session

# Documented in docs/models.md: ORT float16 (every activation rounded to float16) against the
# float64 reference from the same float16 weights, logits of magnitude ~10. Measured up to
# about 5e-3 on the tiny preset; float16's spacing at 8 is 7.8e-3.
FP16_ATOL = 2e-2
FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16}


@pytest.fixture(scope="module")
def fp16_model(tmp_path_factory):
    built = {}

    def build(variant: str = "base", dtype: str = "float16"):
        if (variant, dtype) not in built:
            folder = tmp_path_factory.mktemp(f"{dtype}-{variant}")
            built[variant, dtype] = build_decoder(folder, variant=variant, seed=4, dtype=dtype)
        return built[variant, dtype]

    return build


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_float_port_and_weight_is_float16(fp16_model, variant):
    path = fp16_model(variant)
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)
    ports = [*model.graph.input, *model.graph.output]
    float_ports = {p.name: p.type.tensor_type.elem_type for p in ports
                   if p.type.tensor_type.elem_type in FLOAT_TYPES}
    assert "logits" in float_ports and any(name.startswith("present.") for name in float_ports)
    assert set(float_ports.values()) == {TensorProto.FLOAT16}, float_ports
    float32_inits = [i.name for i in model.graph.initializer if i.data_type == TensorProto.FLOAT]
    # Only RMSNorm's epsilon stays float32: the norm runs in float32 between two Casts.
    assert float32_inits and all(name.startswith("/model/constants/FLOAT/") for name in
                                 float32_inits), float32_inits
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa and {n.input[7] for n in gqa if len(n.input) > 7} <= {"cos_cache"}
    meta = {p.key: json.loads(p.value) for p in model.metadata_props}
    assert meta["onnx_chunk.reference_decoder"]["dtype"] == "float16"


def test_float16_graph_is_the_float32_graph_plus_norm_casts(fp16_model):
    wide = onnx.load(str(fp16_model("base", "float32")), load_external_data=True)
    narrow = onnx.load(str(fp16_model("base")), load_external_data=True)
    norms = sum(n.op_type == "ReduceMean" for n in wide.graph.node)
    narrow_ops = [(n.name, n.op_type, list(n.input)) for n in narrow.graph.node
                  if n.op_type != "Cast" or "layernorm" not in n.name and "/norm/" not in n.name]
    casts = [n for n in narrow.graph.node if n.op_type == "Cast"
             and ("layernorm" in n.name or "/norm/" in n.name)]
    assert len(casts) == 2 * norms == 2 * (2 * 2 + 1)
    assert [(n.name, n.op_type) for n in wide.graph.node] == [op[:2] for op in narrow_ops]
    wide_weights = {i.name: numpy_helper.to_array(i) for i in wide.graph.initializer}
    narrow_weights = {i.name: numpy_helper.to_array(i) for i in narrow.graph.initializer}
    assert wide_weights.keys() == narrow_weights.keys()
    for name, array in narrow_weights.items():
        if array.dtype == np.float16:
            np.testing.assert_array_equal(array, wide_weights[name].astype(np.float16), name)
        else:
            np.testing.assert_array_equal(array, wide_weights[name], name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float16_prompt_and_decode_match_the_reference(fp16_model, variant):
    path = fp16_model(variant)
    ref = ReferenceDecoder.from_model_dir(path.parent)
    sess = session(path)
    ids = np.random.default_rng(7).integers(0, ref.config.vocab_size, size=(1, 11))
    state_feeds, state, past = empty_state_feeds(ref, dtype=np.float16), None, 0
    for _ in range(4):
        rows = ids.shape[1]
        positions = (1 + np.arange(past, past + rows, dtype=np.int64))[None]
        row_scale = np.linspace(0.75, 1.25, rows).astype(np.float16)
        feeds, kwargs = request_feeds(ref, ids, past, positions, row_scale)
        if "inputs_embeds" in feeds:
            feeds["inputs_embeds"] = feeds["inputs_embeds"].astype(np.float16)
        outputs = run(sess, {**feeds, **state_feeds})
        assert outputs["logits"].dtype == np.float16
        expected, state = ref.forward(state=state, **kwargs)
        logits = outputs["logits"].astype(np.float32)
        assert np.abs(expected).max() > 1.0
        np.testing.assert_allclose(logits, expected, atol=FP16_ATOL, rtol=0)
        for layer in ref.config.attention_layers:
            for kind, ours in (("key", state.keys), ("value", state.values)):
                present = outputs[f"present.{layer}.{kind}"]
                assert present.dtype == np.float16
                np.testing.assert_allclose(present.astype(np.float64), ours[layer],
                                           atol=FP16_ATOL, rtol=0)
        for layer in ref.config.conv_layers:
            np.testing.assert_allclose(outputs[f"present.{layer}.conv"].astype(np.float64),
                                       state.conv[layer], atol=FP16_ATOL, rtol=0)
        state_feeds = carry(outputs)
        past += rows
        token = int(np.argmax(logits[0, -1]))
        top_two = np.sort(expected[0, -1])[-2:]
        if top_two[1] - top_two[0] > 2 * FP16_ATOL:
            assert token == int(np.argmax(expected[0, -1]))
        ids = np.array([[token]], dtype=np.int64)


def test_int4_float16_runs_matmulnbits_on_float16_activations(fp16_model):
    path = fp16_model("int4")
    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name: i.data_type for i in model.graph.initializer}
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 * 7 + 1
    assert {inits[n.input[2]] for n in nbits} == {TensorProto.FLOAT16}
    assert not any(n.op_type == "MatMul" for n in model.graph.node)


def test_same_seed_gives_identical_bytes(tmp_path, fp16_model):
    again = build_decoder(tmp_path, variant="int4", seed=4, dtype="float16")
    first = fp16_model("int4")
    for name in ("model.onnx", "model.onnx.data", "genai_config.json"):
        assert (first.parent / name).read_bytes() == (again.parent / name).read_bytes(), name


def test_genai_config_asks_for_cuda_for_float16_only(fp16_model):
    def options(dtype):
        text = (fp16_model("base", dtype).parent / "genai_config.json").read_text()
        return json.loads(text)["model"]["decoder"]["session_options"]["provider_options"]

    assert options("float16") == [{"cuda": {}}]
    assert options("float32") == []


def test_unknown_dtype_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown dtype 'bfloat16'"):
        build_decoder(tmp_path, dtype="bfloat16")
    assert not (tmp_path / "model.onnx").exists()


def test_cli_builds_float16_and_refuses_static_float16(tmp_path, capsys):
    assert main(["build-model", "tiny", "-o", str(tmp_path / "a"), "--dtype", "float16"]) == 0
    assert "float16" in capsys.readouterr().out
    model = onnx.load(str(tmp_path / "a" / "model.onnx"), load_external_data=False)
    logits = next(o for o in model.graph.output if o.name == "logits")
    assert logits.type.tensor_type.elem_type == TensorProto.FLOAT16
    code = main(["build-model", "tiny", "-o", str(tmp_path / "s"), "--variant", "static",
                 "--chunk-size", "4", "--capacity", "16", "--dtype", "float16"])
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("error: ") and "float32 only" in err
    assert not (tmp_path / "s" / "model.onnx").exists()
