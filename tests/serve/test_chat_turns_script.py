"""scripts/bench_chat_turns.py runs an HTTP chat on two servers and reports the ratios."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.serve.conftest import EXPORT

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_chat_turns.py"


def test_the_chat_turns_bench_reports_cached_tokens_and_both_ratios(tmp_path):
    out = tmp_path / "turns.json"
    done = subprocess.run([sys.executable, str(SCRIPT), str(EXPORT), "--turns", "3",
                           "--new-tokens", "30", "--max-tokens", "4", "--rounds", "1",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    reuse, plain = runs["reuse"][0], runs["no reuse"][0]
    # Each later turn reused at least the earlier turn's prompt; the server without reuse none.
    for turn in (1, 2):
        assert reuse[turn]["cached_tokens"] >= reuse[turn - 1]["prompt_tokens"]
    assert all(turn["cached_tokens"] == 0 for turn in plain)
    assert all(turn["ttft_s"] > 0 for turn in reuse + plain)
    assert re.search(r"turn 3: TTFT without reuse / with reuse \| [\d.]+ \|", done.stdout)
    assert re.search(r"turn 3: TTFT with reuse / its new tokens alone \| [\d.]+ \|",
                     done.stdout)
    assert "load average before / after" in done.stdout
