"""scripts/bench_logprobs.py --quick: both systems measured, interleaved, on a fixture."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_logprobs.py"


def test_the_logprobs_benchmark_quick_mode(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "logprobs_quick.json").read_text())
    assert set(data["runs"]) == {"no logprobs", "top_logprobs 5"}
    for runs in data["runs"].values():
        assert len(runs) == data["repetitions"] == 2
        assert all(run["tokens_per_s"] > 0 and run["tokens"] == 32 for run in runs)
    assert data["ratio"] > 0 and len(data["load_average"]) == 2
    assert "top_logprobs 5" in (tmp_path / "logprobs_quick.md").read_text()
