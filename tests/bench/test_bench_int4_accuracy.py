"""scripts/bench_int4_accuracy.py: perplexity and greedy agreement of an INT4 export re-blocked
by `convert --int4-block-size`, against the export as it is, on a corpus export (quick mode)."""

from __future__ import annotations

import argparse
import json
import math
import sys

import pytest

from scripts._bench import environment as env

sys.path.insert(0, str(env.ROOT / "scripts"))
import bench_int4_accuracy  # noqa: E402  (a script, imported from its folder)

EXPORTS = env.ROOT / "tests" / "fixtures" / "exports"
INT4, FP32 = EXPORTS / "genai-llama-int4", EXPORTS / "genai-llama-fp32"
HELD = ("You may reproduce and distribute copies of the work or derivative works thereof in "
        "any medium, with or without modifications, in source or object form.\n") * 4


def _held(tmp_path):
    held = tmp_path / "held.txt"
    held.write_text(HELD)
    return ["--held-out", str(held)]


def test_quick_run_measures_each_block_size_against_the_export_as_it_is(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert bench_int4_accuracy.main([str(INT4), "--float", str(FP32), "--blocks", "64,128",
                                     "--quick", "--out", str(tmp_path / "models"), "--json",
                                     str(out), "--threads", "1", *_held(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "CPU: " in printed and "load average" in printed
    assert "| block 128 | " in printed and "| float32 weights | " in printed
    assert "Agreement is with its float32 weights" in printed
    report = json.loads(out.read_text())
    results = report["results"]
    reference, floor = bench_int4_accuracy.REFERENCE, bench_int4_accuracy.FLOAT
    assert list(results) == [floor, reference, "block 64", "block 128"]
    assert report["agreement_with"] == floor
    commands = report["convert_commands"]
    # The reference keeps the export's 4-bit weights: the default would rewrite them as int8.
    assert "--int4-block-size" not in commands[reference]
    assert commands[reference].endswith("--no-int8-matmul")
    assert commands["block 128"].endswith("--int4-block-size 128")
    assert "genai-llama-fp32" in commands[floor]
    base = results[floor]
    assert base["row_agreement"] == 1.0 and base["tokens_scored"] == 4 * 31
    assert results[reference]["row_agreement"] < 1.0  # 4-bit weights part from float ones
    for result in results.values():
        assert math.isfinite(result["perplexity"]) and result["perplexity"] > 1.0
        assert 0.0 <= result["greedy_agreement"] <= 1.0
    # Each arm is its own conversion: re-blocked weights and float weights score differently.
    assert len({round(result["perplexity"], 9) for result in results.values()}) == len(results)
    blocks = {}
    import onnx

    for name in ("block-64", "block-128"):
        model = onnx.load(tmp_path / "models" / name / "model.onnx", load_external_data=False)
        blocks[name] = {attribute.i for node in model.graph.node if node.op_type == "MatMulNBits"
                        for attribute in node.attribute if attribute.name == "block_size"}
    assert blocks == {"block-64": {64}, "block-128": {128}}


@pytest.mark.parametrize("argv", [["--blocks", "32"], ["--blocks", "48"], ["--blocks", "x"],
                                  ["--blocks", "64,64"], ["--window", "1"],
                                  ["--float", "no-such-model"], ["no-such-model"],
                                  ["--llamacpp", "--gguf-float", "no-such.gguf"],
                                  ["--llamacpp", "--gguf-quant", "text-q8_0"],
                                  ["--llamacpp", "--llama-python", "no-such-python"],
                                  ["--gguf-quant", "text-q4_0"], ["--llama-python", "x"]])
def test_bad_arguments_are_one_error_line(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_int4_accuracy.main(([str(INT4)] if argv[0].startswith("--") else [])
                                 + argv + ["--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("error:") == 1


def test_the_int8_matmul_arm_is_its_own_conversion(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert bench_int4_accuracy.main([str(INT4), "--float", "none", "--blocks", "none",
                                     "--int8-matmul", "--quick", "--out",
                                     str(tmp_path / "models"), "--json", str(out), "--threads",
                                     "1", *_held(tmp_path)]) == 0
    assert "| int8 matmul (the default) | " in capsys.readouterr().out
    report = json.loads(out.read_text())
    int8 = bench_int4_accuracy.INT8
    assert list(report["results"]) == [bench_int4_accuracy.REFERENCE, int8]
    assert report["agreement_with"] == bench_int4_accuracy.REFERENCE
    assert report["convert_commands"][int8].endswith("--int8-matmul")
    import onnx

    model = onnx.load(tmp_path / "models" / "int8-matmul" / "model.onnx",
                      load_external_data=False)
    assert "MatMulInteger" in {node.op_type for node in model.graph.node}



def test_llamacpp_arms_are_labelled_by_their_files(tmp_path, capsys):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "same.gguf").write_bytes(b"GGUF")
    common = ["--llamacpp", "--llama-python", sys.executable, "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        bench_int4_accuracy.main([str(INT4), *common, "--gguf-float",
                                  str(tmp_path / "a" / "same.gguf"), "--gguf-quant",
                                  str(tmp_path / "b" / "same.gguf")])
    assert exit_info.value.code == 2
    assert "one file stem (same)" in capsys.readouterr().err
    (tmp_path / "b" / "other.gguf").write_bytes(b"GGUF")
    args = argparse.Namespace(llamacpp=True, llama_python=sys.executable,
                              gguf_float=str(tmp_path / "a" / "same.gguf"),
                              gguf_quant=str(tmp_path / "b" / "other.gguf"))
    _, arms = bench_int4_accuracy.llamacpp_setup(args)
    assert list(arms) == ["llama.cpp same", "llama.cpp other"]
