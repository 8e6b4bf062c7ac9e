"""KVCacheQuantizationPass and `convert --kv-dtype`: the rewrite's rules on every
GroupQueryAttention export of the corpus, the calibration file, and every refusal in one
line."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnx_chunk.calibration import BUILTIN_PROMPTS, calibrate_kv, read_calibration_file
from onnx_chunk.cli import main
from onnx_chunk.errors import ConfigError, InputError, ModelStructureError
from onnx_chunk.graph import metadata
from onnx_chunk.graph.model_io import load_model
from onnx_chunk.passes import KVCacheQuantizationPass, check_kv_quantization, convert_model
from onnx_chunk.passes.kv_quantization import QMAX, Calibration, KVRange, scale_values
from onnx_chunk.passes.value_tracing import gqa_nodes
from tests.cli_output import one_error_line
from tests.exports.corpus import builder_gqa_fixtures, fixtures

FIXTURES = builder_gqa_fixtures()
CASES = [pytest.param(fixture, kv_dtype, kv_scales, id=f"{fixture}-{kv_dtype}-{kv_scales}")
         for fixture in FIXTURES for kv_dtype in ("int8", "int4")
         for kv_scales in ("per-channel", "per-tensor")
         if not (kv_dtype == "int4" and fixture.features.get("sliding_window"))]
LLAMA = next(fixture for fixture in FIXTURES if fixture.name == "genai-llama-fp32")


@pytest.fixture(scope="module")
def calibrated():
    """Each fixture's calibration on two built-in prompts, made once."""
    made: dict[str, Calibration] = {}

    def calibration(fixture) -> Calibration:
        if fixture.name not in made:
            made[fixture.name] = calibrate_kv(fixture.folder, BUILTIN_PROMPTS[:2])
        return made[fixture.name]

    return calibration


def _gqa(model: ir.Model) -> list[ir.Node]:
    # With the prefill routed to float attention (the default) each one sits in an If.
    return gqa_nodes(model.graph)


@pytest.mark.parametrize(("fixture", "kv_dtype", "kv_scales"), CASES)
def test_every_gqa_export_gets_the_quantized_cache(fixture, kv_dtype, kv_scales, calibrated):
    calibration = calibrated(fixture)
    model = load_model(fixture.folder / "model.onnx")
    result = convert_model(model, chunk_size=64, kv_dtype=kv_dtype, kv_scales=kv_scales,
                           calibration=calibration)
    assert result.modified
    model = result.model
    head = fixture.features["head_dim"]
    kv_heads = fixture.features["num_key_value_heads"]
    cache_type = ir.DataType.INT8 if kv_dtype == "int8" else ir.DataType.UINT8
    packed = head if kv_dtype == "int8" else head // 2
    nodes = _gqa(model)
    assert nodes
    for node in nodes:
        # Rule 4: both caches of a node quantized alike.
        assert node.attributes["k_quant_type"].as_string() == kv_scales.replace("-", "_").upper()
        assert node.attributes["v_quant_type"].as_string() == kv_scales.replace("-", "_").upper()
        assert node.attributes["kv_cache_bit_width"].as_int() == (8 if kv_dtype == "int8" else 4)
        for past_index, present_index, scale_index in ((3, 1, 12), (4, 2, 13)):
            past, present = node.inputs[past_index], node.outputs[present_index]
            # Rule 2: retyped, the head axis fixed (packed two a byte for int4).
            for value in (past, present):
                assert value.dtype == cache_type and value.shape[3] == packed
            # Rule 3: the scale is the calibrated range over the code's largest magnitude.
            scale = node.inputs[scale_index]
            assert scale.name == f"{past.name}.scale"
            amax = calibration.ranges[past.name].amax
            values = scale.const_value.numpy()
            if kv_scales == "per-tensor":
                assert values.shape == (1,)
                np.testing.assert_allclose(values, [amax.max() / QMAX[kv_dtype]], rtol=1e-6)
            else:
                assert values.shape == (1, kv_heads, 1, head)
                np.testing.assert_allclose(values[0, :, 0, :], amax / QMAX[kv_dtype], rtol=1e-6)
    declared = metadata.read_kv_cache(model)
    assert declared == metadata.KVCacheDeclaration(
        dtype=kv_dtype, scales=kv_scales, calibration_prompts=2,
        calibration_tokens=calibration.tokens, calibration_source="built-in prompts")
    # The plan binds the retyped buffers with their fixed head axis.
    plan = metadata.read_plan(model)
    assert {binding.head_size for binding in plan.capacity_inputs} == {packed}
    # Rule 7: the same calibration again changes nothing.
    again = KVCacheQuantizationPass(calibration, kv_dtype, kv_scales)(model)
    assert not again.modified


def test_scales_per_tensor_and_per_channel_and_a_channel_that_never_moved():
    amax = np.array([[1.27, 0.0], [2.54, 0.127]])
    np.testing.assert_allclose(scale_values(amax, "int8", "per-tensor"), [0.02])
    channel = scale_values(amax, "int8", "per-channel")
    assert channel.shape == (1, 2, 1, 2) and channel.dtype == np.float32
    # The channel with range 0 gets the smallest nonzero channel's scale, never 0.
    np.testing.assert_allclose(channel.reshape(2, 2), [[0.01, 0.001], [0.02, 0.001]],
                               rtol=1e-6)
    np.testing.assert_allclose(scale_values(amax, "int4", "per-tensor"), [2.54 / 7], rtol=1e-6)


def test_a_layer_whose_range_is_zero_is_refused_by_name(calibrated):
    calibration = calibrated(LLAMA)
    ranges = dict(calibration.ranges)
    ranges["past_key_values.1.value"] = KVRange(np.zeros_like(
        ranges["past_key_values.1.value"].amax))
    model = load_model(LLAMA.folder / "model.onnx")
    zero = Calibration(ranges, calibration.prompts, calibration.tokens, "test")
    with pytest.raises(ConfigError, match=r"'past_key_values\.1\.value'.*range of zero"):
        convert_model(model, kv_dtype="int8", calibration=zero)
    del ranges["past_key_values.1.value"]
    missing = Calibration(ranges, calibration.prompts, calibration.tokens, "test")
    with pytest.raises(ModelStructureError, match="no calibrated range"):
        convert_model(load_model(LLAMA.folder / "model.onnx"), kv_dtype="int8",
                      calibration=missing)


def test_every_refusal_comes_before_any_node_is_rewritten(calibrated, make_decoder):
    calibration = calibrated(LLAMA)
    ranges = dict(calibration.ranges)
    del ranges["past_key_values.1.value"]
    missing = Calibration(ranges, calibration.prompts, calibration.tokens, "test")
    model = load_model(LLAMA.folder / "model.onnx")
    with pytest.raises(ModelStructureError, match="no calibrated range") as no_range:
        KVCacheQuantizationPass(missing)(model)
    # Layer 0 has both ranges and is still float: the refusal came before any rewrite.
    assert {node.inputs[3].dtype for node in _gqa(model)} == {ir.DataType.FLOAT}
    with pytest.raises(ModelStructureError, match="not com.microsoft::GroupQueryAttention") \
            as no_gqa:
        KVCacheQuantizationPass(calibration)(make_decoder(gqa=False))
    assert all(isinstance(refused.value, ir.passes.PreconditionError)
               for refused in (no_range, no_gqa))


def test_a_cache_quantized_otherwise_is_refused_and_a_float_one_needs_a_calibration(calibrated):
    calibration = calibrated(LLAMA)
    model = convert_model(load_model(LLAMA.folder / "model.onnx"), kv_dtype="int8",
                          calibration=calibration).model
    with pytest.raises(ModelStructureError, match="already has a INT8 KV cache") as refused:
        KVCacheQuantizationPass(calibration, "int8", "per-tensor")(model)
    assert isinstance(refused.value, ir.passes.PreconditionError)  # requires() refused it
    with pytest.raises(ConfigError, match="needs a calibration"):
        convert_model(load_model(LLAMA.folder / "model.onnx"), kv_dtype="int8")


@pytest.mark.parametrize("fixture", [fixture for fixture in FIXTURES
                                     if fixture.features.get("sliding_window")], ids=str)
def test_an_int4_window_cache_at_head_size_16_is_refused(fixture):
    """ONNX Runtime 1.32's CPU kernel: "sliding_window_cache: head_size (16) must be a
    multiple of 32 for a 4-bit KV cache"; int8 converts (tested above)."""
    with pytest.raises(ModelStructureError, match="multiple of 32: use --kv-dtype int8"):
        check_kv_quantization(load_model(fixture.folder / "model.onnx"), "int4")


def test_cli_converts_with_a_text_file_a_token_file_and_the_built_in_prompts(tmp_path, capsys):
    text = tmp_path / "prompts.txt"
    text.write_text("The river runs past the mill.\n\nA second prompt, about bread.\n")
    tokens = tmp_path / "ids.txt"
    tokens.write_text("5, 6, 7, 8\n9 10 11 12 13\n")
    for name, extra, prompts, source in (
            ("text", ["--calibrate", str(text)], 2, "prompts.txt"),
            ("tokens", ["--calibrate", str(tokens), "--kv-scales", "per-tensor"], 2, "ids.txt"),
            ("builtin", [], len(BUILTIN_PROMPTS), "built-in prompts")):
        out = tmp_path / name
        assert main(["convert", str(LLAMA.folder), "-o", str(out), "--kv-dtype", "int8",
                     *extra]) == 0
        declared = metadata.read_kv_cache(onnx.load(str(out / "model.onnx"),
                                                    load_external_data=False))
        assert declared.calibration_prompts == prompts
        assert declared.calibration_source == source
    assert declared.scales == "per-channel"
    assert metadata.read_kv_cache(onnx.load(str(tmp_path / "tokens" / "model.onnx"),
                                            load_external_data=False)).calibration_tokens == 9


def test_a_calibration_file_is_token_ids_only_when_every_line_is(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("1, 2, 3,\n\n4 5\n")
    assert read_calibration_file(path) == [[1, 2, 3], [4, 5]]
    path.write_text("1 2 3\nIn 1969 the river rose.\n")
    assert read_calibration_file(path) == ["1 2 3", "In 1969 the river rose."]
    with pytest.raises(InputError, match="cannot read"):
        read_calibration_file(tmp_path / "missing.txt")


@pytest.mark.parametrize(("content", "words"), [
    (b"", ("holds no prompt",)),
    (b"\n  \n\t\n", ("holds no prompt",)),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", ("is not UTF-8 text",)),
    (b"text\x00with a NUL\n", ("is not text",)),
    (None, ("cannot read the calibration file",)),
    ("directory", ("cannot read the calibration file",)),
], ids=["empty", "blank", "binary", "nul", "missing", "directory"])
def test_bad_calibration_files_get_one_error_line(tmp_path, capsys, content, words):
    path = tmp_path / "calibration.txt"
    if content == "directory":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    out = tmp_path / "out"
    code = main(["convert", str(LLAMA.folder), "-o", str(out), "--kv-dtype", "int8",
                 "--calibrate", str(path)])
    assert code == 2
    one_error_line(capsys, *words)
    assert not out.exists()


def test_refusals_in_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    fp16 = next(fixture for fixture in fixtures("genai") if fixture.precision == "fp16")
    assert main(["convert", str(fp16.folder), "-o", str(out), "--kv-dtype", "int8"]) == 2
    one_error_line(capsys, "not com.microsoft::GroupQueryAttention")
    optimum = fixtures("optimum")[0]
    assert main(["convert", str(optimum.folder), "-o", str(out), "--kv-dtype", "int8"]) == 2
    one_error_line(capsys, "grows its KV cache by Concat", "convert it first")
    assert main(["convert", str(LLAMA.folder), "-o", str(out), "--kv-scales",
                 "per-tensor"]) == 2
    one_error_line(capsys, "--kv-scales applies to a quantized KV cache only")
    # An ONNX Runtime whose GroupQueryAttention schema has no such cache.
    from onnx_chunk import ort_schemas

    monkeypatch.setattr(ort_schemas, "gqa_cache_types",
                        lambda: frozenset({"tensor(float)", "tensor(float16)"}))
    assert main(["convert", str(LLAMA.folder), "-o", str(out), "--kv-dtype", "int4"]) == 2
    one_error_line(capsys, "has no GroupQueryAttention with a int4 KV cache")
    assert not out.exists()


def test_the_schema_of_this_onnxruntime_has_both_cache_types():
    from onnx_chunk.ort_schemas import gqa_cache_types

    assert {"tensor(int8)", "tensor(uint8)"} <= gqa_cache_types()


def test_a_concat_kv_decoder_is_quantized_once_converted(tmp_path, capsys):
    """Optimum's export: convert to GroupQueryAttention first, then quantize in place; the
    runtime runs the int8 cache."""
    from onnx_chunk.runtime import load

    optimum = fixtures("optimum")[0]
    folder = tmp_path / "converted"
    assert main(["convert", str(optimum.folder), "-o", str(folder)]) == 0
    assert main(["convert", str(folder), "--in-place", "--kv-dtype", "int8"]) == 0
    with load(folder, provider="cpu", capacity=64) as runtime:
        assert runtime.stats.kv_dtype == "int8"
        assert len(runtime.open_sequence().generate([5, 6, 7, 8], 4, eos_token_id=[])) == 4


def test_float16_attention_and_head_sizes_the_kernel_cannot_quantize_are_refused(monkeypatch):
    from onnx_chunk.passes import kv_quantization

    model = load_model(LLAMA.folder / "model.onnx")
    query = _gqa(model)[0].inputs[0]
    query.dtype = ir.DataType.FLOAT16
    with pytest.raises(ModelStructureError, match="computes in FLOAT16"):
        check_kv_quantization(model, "int8")
    # The rule that a head size is a multiple of the kernel's group (8), shown at 32 on the
    # corpus's head size 16.
    monkeypatch.setattr(kv_quantization, "HEAD_SIZE_MULTIPLE", 32)
    with pytest.raises(ModelStructureError, match="head size 16.*groups of 32"):
        check_kv_quantization(load_model(LLAMA.folder / "model.onnx"), "int8")
