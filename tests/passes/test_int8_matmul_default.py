"""`convert`'s default for 4-bit weights: a CPU export's layers become int8 matmuls with one
activation scale per row (`--int8-matmul`), wherever the pass applies; `--no-int8-matmul`, an
export built for a GPU provider, `--int4-block-size` and an ONNX Runtime without the kernel keep
the 4-bit weights, and the summary says which and why."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest

from onnx_chunk.cli import main
from onnx_chunk.errors import ConfigError
from onnx_chunk.graph import metadata
from onnx_chunk.graph.model_folder import read_genai_config
from onnx_chunk.graph.model_io import load_model
from onnx_chunk.passes import convert_model, int8_matmul_default
from onnx_chunk.passes.int8_matmul import default_refusal
from tests.cli_output import one_error_line
from tests.exports.corpus import GENAI, fixtures

INT4 = [fixture for fixture in fixtures(GENAI) if fixture.precision == "int4"]
FP32_LLAMA = next(fixture for fixture in fixtures(GENAI) if fixture.name == "genai-llama-fp32")
DEFAULT_LINE = "matmuls: int8 with one activation scale per row, the default for a CPU export"


def _op_types(folder) -> list[str]:
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    return [node.op_type for node in model.graph.node]


def _nbits(folder) -> list[int]:
    """The bit width of each MatMulNBits node in the folder's model."""
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    return [attribute.i for node in model.graph.node if node.op_type == "MatMulNBits"
            for attribute in node.attribute if attribute.name == "bits"]


def _block_sizes(folder) -> set[int]:
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    return {attribute.i for node in model.graph.node if node.op_type == "MatMulNBits"
            for attribute in node.attribute if attribute.name == "block_size"}


@pytest.mark.parametrize("fixture", INT4, ids=str)
def test_the_default_conversion_of_a_cpu_export_writes_int8_matmuls(fixture, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(fixture.folder), "-o", str(out)]) == 0
    assert DEFAULT_LINE in capsys.readouterr().out
    ops = _op_types(out)
    declaration = metadata.read_int8_matmul(load_model(out / "model.onnx"))
    assert declaration is not None and declaration.rewritten_nodes == ops.count("MatMulInteger")
    assert ops.count("MatMulInteger") > 0
    # What stays 4-bit is the lm_head over a tied embedding (rule 2), nothing else; an 8-bit
    # lm_head (genai-llama-int4h8) stays as exported.
    assert _nbits(out).count(4) == declaration.kept_int4_nodes <= 1
    assert sorted(bits for bits in _nbits(out) if bits != 4) == sorted(
        bits for bits in _nbits(fixture.folder) if bits != 4)


def test_no_int8_matmul_keeps_the_weights_as_exported(tmp_path, capsys):
    source = INT4[0].folder
    assert main(["convert", str(source), "-o", str(tmp_path / "out"), "--no-int8-matmul"]) == 0
    assert "matmuls:" not in capsys.readouterr().out
    ops = _op_types(tmp_path / "out")
    assert "MatMulInteger" not in ops
    assert ops.count("MatMulNBits") == _op_types(source).count("MatMulNBits")


def test_an_export_for_a_gpu_keeps_its_4bit_weights_unless_asked(tmp_path, capsys):
    source = tmp_path / "cuda-export"
    shutil.copytree(INT4[0].folder, source)
    config = json.loads((source / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["provider_options"] = [{"cuda": {}}]
    (source / "genai_config.json").write_text(json.dumps(config))
    assert read_genai_config(source / "genai_config.json").providers() == ("cuda",)
    assert main(["convert", str(source), "-o", str(tmp_path / "kept")]) == 0
    assert ("matmuls: 4-bit as exported (genai_config.json targets cuda; --int8-matmul "
            "rewrites them for the CPU)") in capsys.readouterr().out
    assert "MatMulInteger" not in _op_types(tmp_path / "kept")
    assert main(["convert", str(source), "-o", str(tmp_path / "asked"), "--int8-matmul"]) == 0
    assert "MatMulInteger" in _op_types(tmp_path / "asked")


def test_a_reblocking_keeps_4bit_weights(tmp_path, capsys):
    assert main(["convert", str(INT4[0].folder), "-o", str(tmp_path / "out"),
                 "--int4-block-size", "128"]) == 0
    assert "matmuls: 4-bit, re-blocked" in capsys.readouterr().out
    assert "MatMulInteger" not in _op_types(tmp_path / "out")
    assert _block_sizes(tmp_path / "out") == {128}


def test_a_float_export_gets_no_matmul_line(tmp_path, capsys):
    assert main(["convert", str(FP32_LLAMA.folder), "-o", str(tmp_path / "out")]) == 0
    assert "matmuls:" not in capsys.readouterr().out
    assert "MatMulInteger" not in _op_types(tmp_path / "out")


def test_without_the_kernel_the_default_keeps_4bit_weights_and_says_why(tmp_path, capsys,
                                                                          monkeypatch):
    """An ONNX Runtime whose MatMulInteger takes no uint8 activations: the default converts
    anyway, keeping the weights; `--int8-matmul` asked for is refused."""
    from onnx_chunk import ort_schemas

    monkeypatch.setattr(ort_schemas, "input_types", lambda *_: frozenset({"tensor(int8)"}))
    model = load_model(INT4[0].folder / "model.onnx")
    assert "no MatMulInteger of uint8 activations" in default_refusal(model)
    assert not int8_matmul_default(model, None)
    assert main(["convert", str(INT4[0].folder), "-o", str(tmp_path / "out")]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "matmuls:" in line)
    assert "4-bit as they are (the installed ONNX Runtime" in line
    assert "convert without" not in line  # the option's remedy is not the default's reason
    assert "MatMulInteger" not in _op_types(tmp_path / "out")
    assert main(["convert", str(INT4[0].folder), "-o", str(tmp_path / "asked"),
                 "--int8-matmul"]) == 2


def test_the_python_api_has_the_same_default():
    converted = convert_model(load_model(INT4[0].folder / "model.onnx")).model
    assert metadata.read_int8_matmul(converted) is not None
    kept = convert_model(load_model(INT4[0].folder / "model.onnx"), int8_matmul=False).model
    assert metadata.read_int8_matmul(kept) is None
    assert any(node.op_type == "MatMulNBits" for node in kept.graph)
    float_model = convert_model(load_model(FP32_LLAMA.folder / "model.onnx")).model
    assert metadata.read_int8_matmul(float_model) is None


def test_a_converted_folder_keeps_its_matmuls_by_default(tmp_path, capsys):
    """Converting a converted folder again (another chunk size, a quantized KV cache) leaves
    its matmuls as they are: a 4-bit folder stays 4-bit, an int8 one int8."""
    kept = tmp_path / "kept"
    assert main(["convert", str(INT4[0].folder), "-o", str(kept), "--no-int8-matmul",
                 "-q"]) == 0
    capsys.readouterr()
    assert main(["convert", str(kept), "--in-place", "--chunk-size", "256"]) == 0
    assert "matmuls: 4-bit, as converted before (--int8-matmul" in capsys.readouterr().out
    assert "MatMulInteger" not in _op_types(kept)
    int8 = tmp_path / "int8"
    assert main(["convert", str(INT4[0].folder), "-o", str(int8), "-q"]) == 0
    assert main(["convert", str(int8), "-o", str(tmp_path / "again"), "--chunk-size",
                 "256"]) == 0
    assert "matmuls: int8, as converted before" in capsys.readouterr().out
    assert "MatMulInteger" in _op_types(tmp_path / "again")


def test_no_int8_matmul_on_an_int8_folder_is_refused(tmp_path, capsys):
    """The 4-bit weights are gone from an int8 folder: --no-int8-matmul cannot keep them."""
    int8 = tmp_path / "int8"
    assert main(["convert", str(INT4[0].folder), "-o", str(int8), "-q"]) == 0
    capsys.readouterr()
    assert main(["convert", str(int8), "-o", str(tmp_path / "out"), "--no-int8-matmul"]) == 2
    one_error_line(capsys, "--no-int8-matmul", "convert the original export")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="--no-int8-matmul"):
        convert_model(load_model(int8 / "model.onnx"), int8_matmul=False)


def test_hard_linked_weights_keep_the_default_from_reading_them(tmp_path, capsys):
    """onnx_ir will not read a data file with several names: the default keeps the 4-bit
    weights and says why, where --int8-matmul is refused (test_int8_matmul)."""
    import os

    source = tmp_path / "export"
    shutil.copytree(INT4[0].folder, source)
    os.link(source / "model.onnx.data", tmp_path / "other-name.data")
    assert main(["convert", str(source), "-o", str(tmp_path / "out")]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "matmuls:" in line)
    assert line.startswith("  matmuls: 4-bit as exported (") and "hard links" in line
    assert "MatMulInteger" not in _op_types(tmp_path / "out")


def test_a_float16_export_keeps_its_4bit_weights_by_default():
    """MatMulNBits over float16 activations (a GPU export: the builder's CUDA and DML ones
    compute in float16): the default keeps them, saying why; --int8-matmul is refused."""
    import numpy as np
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    from onnx_chunk.errors import ModelStructureError
    from onnx_chunk.passes import Int8MatMulPass

    k, n, block = 64, 16, 32
    packed = np.full((n, k // block, block // 2), 0x88, np.uint8)
    scales = np.full((n, k // block), 0.01, np.float16)
    node = helper.make_node("MatMulNBits", ["A", "B", "scales"], ["Y"], domain="com.microsoft",
                            name="mm", K=k, N=n, bits=4, block_size=block, accuracy_level=4)
    graph = helper.make_graph(
        [node], "one", [helper.make_tensor_value_info("A", TensorProto.FLOAT16, [1, "rows", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT16, [1, "rows", n])],
        [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "scales")])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]))
    reason = default_refusal(model)
    assert reason is not None and "FLOAT16" in reason and "float32 activations only" in reason
    assert not int8_matmul_default(model, None)
    with pytest.raises(ModelStructureError, match="float32 activations only"):
        Int8MatMulPass()(model)
