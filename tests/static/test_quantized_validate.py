"""validate on fix-shapes output of INT4 exports whose MatMulNBits quantize activations to int8.

The corpus's INT4 builder exports set `accuracy_level` 4: a c-row and a one-row forward differ
by whole quantization steps there (docs/static_graph.md, "Quantized graphs"), so
static.chunked_vs_whole takes a wider tolerance for them on CPU, unless --atol is given, and
never for float graphs.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from onnx_chunk.cli import main
from onnx_chunk.static.fix_shapes import fix_shapes
from onnx_chunk.validate.static import INT8_ACTIVATIONS_ATOL, int8_activations, token_parting
from tests.exports.corpus import ROOT


def test_token_parting_finds_the_first_step_and_the_reference_margin():
    logits = [np.array([0.0, 2.0, 1.5]), np.array([3.0, 0.0, 2.75])]
    assert token_parting([1, 0], [1, 0], logits) is None
    assert token_parting([1, 2], [1, 0], logits) == (1, 0.25)
    assert token_parting([2, 2], [1, 0], logits) == (0, 0.5)


def test_int8_activations_are_read_from_matmulnbits_accuracy_level():
    assert int8_activations(ir.load(ROOT / "genai-llama-int4" / "model.onnx"))
    assert not int8_activations(ir.load(ROOT / "genai-llama-fp32" / "model.onnx"))


def _chunked_vs_whole(capsys, folder, *extra):
    code = main(["validate", str(folder), "--provider", "cpu", "--json", "--lengths",
                 "64,65,150", *extra])
    report = json.loads(capsys.readouterr().out)
    return code, next(check for check in report["checks"]
                      if check["name"] == "static.chunked_vs_whole")


@pytest.fixture(scope="module")
def fixed_exports(tmp_path_factory):
    folders = {}
    for name in ("genai-llama-int4", "genai-llama-fp32"):
        folders[name] = tmp_path_factory.mktemp(name)
        fix_shapes(ROOT / name / "model.onnx", folders[name], rows=64, capacity=512)
    return folders


def test_int8_activations_take_the_measured_tolerance_unless_atol_is_given(
        fixed_exports, capsys):
    code, check = _chunked_vs_whole(capsys, fixed_exports["genai-llama-int4"])
    assert code == 0 and check["outcome"] == "passed", check["reason"]
    assert check["details"]["atol"] == INT8_ACTIVATIONS_ATOL
    assert "int8 activations" in check["reason"]
    worst = max(max(run["logits"], run["kv"]) for run in check["details"]["runs"])
    assert worst > 1e-3  # a quantization step, not a last-ulp difference (length 65)
    code, check = _chunked_vs_whole(capsys, fixed_exports["genai-llama-int4"],
                                    "--atol", "1e-4")
    assert code == 1 and check["outcome"] == "failed" and check["details"]["atol"] == 1e-4


def test_float_graphs_keep_the_static_tolerance(fixed_exports, capsys):
    code, check = _chunked_vs_whole(capsys, fixed_exports["genai-llama-fp32"])
    assert code == 0 and check["details"]["atol"] == 1e-4
    assert not check["details"]["int8_activations"]
