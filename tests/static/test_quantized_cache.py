"""The static runner on a quantized KV cache (`convert --kv-dtype int8|int4`, then `fix-shapes`).

GroupQueryAttention bound at capacity reads and writes the int8 or packed-int4 cache in place,
so the static runner allocates the type and the packed width the graph declares and runs it
as it runs a float cache. On the corpus's GroupQueryAttention exports (gemma2's window caches
in int8 only: the kernel has no int4 window cache at its head size) the static greedy tokens
equal the dynamic runtime's on the same quantized model: at c equal to the runtime's chunk
width both run the same forwards. The rolling layout takes no quantized cache (refused).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest

from onnx_chunk.calibration import calibrate_kv
from onnx_chunk.cli import main
from onnx_chunk.errors import ModelStructureError
from onnx_chunk.graph.model_io import load_model, save_model
from onnx_chunk.models.static_decoder import build_static_pair
from onnx_chunk.passes import convert_model
from onnx_chunk.passes.kv_quantization import cache_scales, dequantize
from onnx_chunk.runtime import load
from onnx_chunk.runtime.device.provider import device_for
from onnx_chunk.static import load_static
from onnx_chunk.static.fix_shapes import fix_shapes
from onnx_chunk.static.runner import StaticRunner
from tests.exports.corpus import ROOT

W = 16
C = 128
NEW = 16
EXPORTS = ("genai-llama-fp32", "genai-llama-int4", "genai-qwen3-fp32", "genai-qwen3-int4",
           "genai-phi3-fp32", "genai-phi3-int4", "genai-gemma2-fp32")
CASES = [pytest.param(name, kv_dtype, id=f"{name}-{kv_dtype}") for name in EXPORTS
         for kv_dtype in ("int8", "int4") if not (name.startswith("genai-gemma2")
                                                 and kv_dtype == "int4")]
CACHE_TYPES = {"int8": np.int8, "int4": np.uint8}


def _config(name: str) -> dict:
    return json.loads((ROOT / name / "genai_config.json").read_text())["model"]


def _prompts(vocab: int, lengths=(5, 40, 77), seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for length in lengths]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """`converted(name, kv_dtype)` -> the folder of the quantized conversion (chunk width W,
    calibrated on the test prompts, no query_seqlens or logits_rows input), with its
    fix-shapes output (rows W, capacity C) in `fixed/`; made once per module."""
    made = {}

    def folder(name: str, kv_dtype: str):
        if (name, kv_dtype) not in made:
            source = ROOT / name
            calibration = calibrate_kv(source, _prompts(_config(name)["vocab_size"]),
                                       source="test prompts")
            model = convert_model(load_model(source / "model.onnx"), chunk_size=W,
                                  kv_dtype=kv_dtype, calibration=calibration,
                                  native_chunks="off", logits_rows="off").model
            target = tmp_path_factory.mktemp(f"{name}-{kv_dtype}")
            save_model(model, target / "model.onnx", companions_from=source)
            fix_shapes(target / "model.onnx", target / "fixed", rows=W, capacity=C)
            made[name, kv_dtype] = target
        return made[name, kv_dtype]

    return folder


@pytest.mark.parametrize(("name", "kv_dtype"), CASES)
def test_static_tokens_equal_the_dynamic_runtimes_on_the_quantized_model(name, kv_dtype,
                                                                         converted):
    folder = converted(name, kv_dtype)
    config = _config(name)
    decoder = config["decoder"]
    runner = load_static(folder / "fixed", provider="cpu")
    assert runner.kv_dtype == kv_dtype
    # Every layer at C (fix-shapes keeps window caches at C too); int4 packs two a byte.
    per_value = {"int8": 1, "int4": 0.5}[kv_dtype]
    assert runner.kv_bytes == (2 * decoder["num_hidden_layers"] * decoder["num_key_value_heads"]
                               * C * decoder["head_size"] * per_value)
    prompts = _prompts(config["vocab_size"])
    with load(folder, provider="cpu", chunk_size=W, capacity=C) as dynamic:
        assert dynamic.stats.kv_dtype == kv_dtype
        if "gemma2" not in name:  # the dynamic runtime holds window caches at the window
            assert dynamic.stats.kv_bytes == runner.kv_bytes
        expected = []
        for prompt in prompts:
            with dynamic.open_sequence() as sequence:
                expected.append(sequence.generate(prompt, NEW, eos_token_id=[]))
    prefill = runner.start(prompts[0], NEW)
    width = decoder["head_size"] if kv_dtype == "int8" else decoder["head_size"] // 2
    for buffer in (*prefill.cache.key_buffers, *prefill.cache.value_buffers):
        assert buffer.dtype == CACHE_TYPES[kv_dtype]
        assert buffer.shape == (1, decoder["num_key_value_heads"], C, width)
    assert runner.decode(prefill, NEW).tokens == expected[0]
    assert [runner.generate(prompt, NEW).tokens for prompt in prompts[1:]] == expected[1:]


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_the_cache_holds_the_float_cache_values_within_half_a_step(kv_dtype, converted,
                                                                   tmp_path):
    """The quantized cache after prefill, dequantized with the graph's scales, is the float
    cache of the same weights rounded: layer 0 (whose input the cache type does not change)
    within half a quantization step, calibrated on this prompt so nothing clips."""
    name = "genai-llama-fp32"
    quantized = load_static(converted(name, kv_dtype) / "fixed", provider="cpu")
    fix_shapes(ROOT / name / "model.onnx", tmp_path / "float", rows=W, capacity=C)
    plain = load_static(tmp_path / "float", provider="cpu")
    prompt = _prompts(_config(name)["vocab_size"])[2]
    scales = cache_scales(load_model(converted(name, kv_dtype) / "fixed" / "chunk.onnx"))
    stored = quantized.start(prompt, 2).cache.recent(len(prompt))
    floats = plain.start(prompt, 2).cache.recent(len(prompt))
    layers = len(stored) // 2
    for index, kind in ((0, "key"), (layers, "value")):
        scale = scales[f"past_key_values.0.{kind}"]
        values = dequantize(stored[index], scale)
        assert values.shape == floats[index].shape
        assert np.all(np.abs(values - floats[index]) <= scale / 2 + 1e-5)
        assert np.abs(floats[index]).max() > 3 * scale.max()  # many steps, not all zeros


def test_dequantize_reads_int8_codes_and_packed_nibbles_low_first():
    scale = np.array([0.5], dtype=np.float32)
    np.testing.assert_array_equal(dequantize(np.array([[-128, 127, 0]], np.int8), scale),
                                  [[-64.0, 63.5, 0.0]])
    # 0x9F: low nibble 15 (value 7), high nibble 9 (value 1); 0x08: 0 then -8.
    np.testing.assert_array_equal(dequantize(np.array([[0x9F, 0x08]], np.uint8), scale),
                                  [[3.5, 0.5, 0.0, -4.0]])
    with pytest.raises(ValueError, match="int8 or uint8"):
        dequantize(np.zeros(2, np.float32), scale)


def test_the_device_path_runs_the_quantized_cache(converted):
    """On CPU marked not host-visible (as CUDA looks) the int4 buffers live off the host and the
    tokens are the host path's."""
    fixed = converted("genai-llama-fp32", "int4") / "fixed"
    pair = (fixed / "chunk.onnx", fixed / "decode.onnx")
    device = StaticRunner(*pair, device=dataclasses.replace(device_for("cpu"),
                                                            host_visible=False))
    host = StaticRunner(*pair, provider="cpu")
    prompt = _prompts(_config("genai-llama-fp32")["vocab_size"])[1]
    prefill = device.start(prompt, NEW)
    assert all(buffer.host is None and buffer.dtype == np.uint8
               for buffer in (*prefill.cache.key_buffers, *prefill.cache.value_buffers))
    assert device.decode(prefill, NEW).tokens == host.generate(prompt, NEW).tokens


def test_the_cli_converts_fixes_validates_and_generates_a_quantized_cache(tmp_path, capsys):
    """`convert --kv-dtype int4` (built-in calibration prompts), `fix-shapes`, then `validate`
    runs every static check on it and `generate` names the cache in its header."""
    converted_dir, fixed = tmp_path / "kv4", tmp_path / "fixed"
    assert main(["convert", str(ROOT / "genai-llama-fp32"), "-o", str(converted_dir),
                 "--kv-dtype", "int4", "--native-chunks", "off", "--logits-rows", "off",
                 "--chunk-size", str(W)]) == 0
    assert main(["fix-shapes", str(converted_dir), "-o", str(fixed), "--rows", str(W),
                 "--capacity", str(C), "--quiet"]) == 0
    capsys.readouterr()
    code = main(["validate", str(fixed), "--provider", "cpu", "--json"])
    report = json.loads(capsys.readouterr().out)
    checks = {check["name"]: check for check in report["checks"]}
    assert code == 0, [check["reason"] for check in report["checks"]
                       if check["outcome"] == "failed"]
    static = [name for name in checks if name.startswith("static.")]
    assert static == ["static.graph", "static.limits", "static.decode_graph",
                      "static.chunked_vs_whole"]
    assert all(checks[name]["outcome"] == "passed" for name in static)
    assert checks["static.decode_graph"]["details"]["kv_dtype"] == "int4"
    assert "int4 KV cache" in checks["static.decode_graph"]["reason"]
    runs = checks["static.chunked_vs_whole"]["details"]["runs"]
    assert all(run["tokens_equal"] and run["kv"] <= 1e-4 for run in runs)
    assert main(["generate", str(fixed), "--random-prompt", "20", "--max-new-tokens", "4"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "2 layers, int4 KV cache (0.01 MiB)" in header


def _cast_cache(path, layers: set[int], kinds=("key", "value")):
    """A copy of the graph at `path` whose listed layers' caches are int8 outside (a Cast to
    float after each past input, a Cast to int8 before each present output): a graph that
    loads, with a quantized cache in its own layout."""
    model = onnx.load(path, load_external_data=False)
    graph = model.graph
    casts = []
    for value in graph.input:
        layer, kind = _layer_of(value.name, "past_key_values.")
        if layer in layers and kind in kinds:
            for node in graph.node:
                node.input[:] = [f"{value.name}.float" if name == value.name else name
                                 for name in node.input]
            casts.append(onnx.helper.make_node("Cast", [value.name], [f"{value.name}.float"],
                                               to=onnx.TensorProto.FLOAT))
            value.type.tensor_type.elem_type = onnx.TensorProto.INT8
    for value in graph.output:
        layer, kind = _layer_of(value.name, "present.")
        if layer in layers and kind in kinds:
            for node in graph.node:
                node.output[:] = [f"{value.name}.float" if name == value.name else name
                                  for name in node.output]
            casts.append(onnx.helper.make_node("Cast", [f"{value.name}.float"], [value.name],
                                               to=onnx.TensorProto.INT8))
            value.type.tensor_type.elem_type = onnx.TensorProto.INT8
    graph.node.extend(casts)
    target = path.parent / f"int8-{path.name}"
    onnx.save(model, target)
    return target


def _layer_of(name: str, prefix: str) -> tuple[int | None, str | None]:
    if not name.startswith(prefix):
        return None, None
    layer, kind = name[len(prefix):].split(".")
    return int(layer), kind


def test_a_quantized_cache_in_the_rolling_layout_is_refused_in_one_line(tmp_path, capsys):
    chunk, decode = build_static_pair(tmp_path, chunk_size=4, capacity=24, seed=3)
    with pytest.raises(ModelStructureError, match="int8 KV cache in the rolling layout"):
        StaticRunner(_cast_cache(chunk, {0, 1}), decode, provider="cpu")
    code = main(["generate", str(_cast_cache(chunk, {0, 1})), "--decode-model", str(decode),
                 "--random-prompt", "5", "--max-new-tokens", "2"])
    error = capsys.readouterr().err
    assert code == 2 and error.startswith("error: ") and error.count("\n") == 1
    assert "only GroupQueryAttention reads a quantized cache" in error
    with pytest.raises(ModelStructureError, match=r"tensor\(float\), tensor\(int8\)"):
        StaticRunner(_cast_cache(chunk, {0}, ("key",)), decode, provider="cpu")


def test_chunk_and_decode_graphs_of_other_cache_types_are_refused(converted):
    int8, int4 = (converted("genai-llama-fp32", kv_dtype) / "fixed" for kv_dtype in
                  ("int8", "int4"))
    with pytest.raises(ModelStructureError, match="disagree on the cache.*int8 against"):
        StaticRunner(int8 / "chunk.onnx", int4 / "decode.onnx", provider="cpu")
