"""scripts/bench_cold_start.py: fresh-process starts on the raw and converted folder, and genai."""

from __future__ import annotations

import json
import sys

import pytest

from scripts._bench import environment as env

sys.path.insert(0, str(env.ROOT / "scripts"))
import bench_cold_start  # noqa: E402  (a script, imported from its folder)

EXPORT = env.ROOT / "tests" / "fixtures" / "exports" / "genai-llama-fp32"


def test_every_arm_starts_and_the_kept_analysis_needs_no_graph_library(tmp_path, peer_python,
                                                                       capsys):
    assert bench_cold_start.main([
        "--model", str(EXPORT), "--repetitions", "1", "--prompt", "8", "--new-tokens", "2",
        "--chunk-size", "64", "--out", str(tmp_path), "--genai-venv",
        str(peer_python.parent.parent)]) == 0
    runs = json.loads((tmp_path / "cold_start_genai-llama-fp32.json").read_text())["runs"]
    assert set(runs) == {"raw, first start", "raw", "converted", "genai"}
    assert {"onnx", "onnx_ir"} <= set(runs["raw, first start"][0]["modules"])
    assert runs["raw"][0]["modules"] == runs["converted"][0]["modules"] == []
    tokens = {arm: runs[arm][0]["tokens"] for arm in runs}
    assert tokens["raw"] == tokens["raw, first start"] == tokens["converted"]
    table = capsys.readouterr().out
    assert "| raw / genai |" in table and "| converted / genai |" in table


@pytest.mark.parametrize("argv", [["--repetitions", "0"], ["--model", "no-such-model"]])
def test_bad_arguments_are_one_error_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_cold_start.main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("error:") == 1
