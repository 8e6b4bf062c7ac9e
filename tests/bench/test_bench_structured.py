"""scripts/bench_structured.py --quick: both systems measured, interleaved, on a fixture."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_structured.py"


def test_the_structured_benchmark_quick_mode(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "structured_quick.json").read_text())
    assert set(data["runs"]) == {"free text", "JSON schema"}
    for runs in data["runs"].values():
        assert len(runs) == data["repetitions"] == 2
        assert all(run["tokens_per_s"] > 0 and run["tokens"] > 0 for run in runs)
    assert data["ratio"] > 0 and len(data["load_average"]) == 2
    assert "JSON schema" in (tmp_path / "structured_quick.md").read_text()


def test_the_grammar_library_comparison_runs_what_is_installed():
    script = SCRIPT.with_name("bench_grammar_libraries.py")
    tokenizer = SCRIPT.parents[1] / "tests" / "fixtures" / "exports" / "genai-qwen3-fp32"
    result = subprocess.run([sys.executable, str(script), "--tokenizer",
                             str(tokenizer / "tokenizer.json"), "--repetitions", "1"],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert "llguidance (" in result.stdout and "mask per token mean" in result.stdout
