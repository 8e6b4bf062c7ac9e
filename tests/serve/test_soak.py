"""scripts/soak.py --quick: the bounded load test runs clean on every cache mode (CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def test_the_quick_soak_has_no_errors_and_the_ladder_stops_compiling(tmp_path):
    out = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = {result["mode"]: result for result in json.loads(out.read_text())["results"]}
    assert sorted(results) == ["auto", "exact", "ladder"]
    for result in results.values():
        assert result["errors"] == 0 and result["server_exit_code"] == 0, result
        assert result["requests"] == 60 and result["ttft_p50_ms"] > 0
        assert [point["requests"] for point in result["checkpoints"]] == [20, 40, 60]
    assert results["auto"]["compiles_after_warmup"] == 0
    assert results["ladder"]["compiles_after_warmup"] == 0
    assert results["exact"]["compiles_after_warmup"] > 0
    assert "| mode | req/s |" in done.stdout


def test_a_chat_mix_soak_reuses_prefixes_with_no_errors(tmp_path):
    out = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--modes", "auto",
                           "--chat-mix", "0.5", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())["results"][0]
    assert result["errors"] == 0 and result["continued"] > 0
    # The server's counters and the responses' usage agree that prefixes were reused.
    assert result["prefix_hits"] > 0 and result["cached_tokens"] > 0
    assert result["checkpoints"][-1]["prefix_hits"] == result["prefix_hits"]
    assert result["verdicts"]["prefix hits"] == "ok"
    assert "| mode | continued requests |" in done.stdout
