"""scripts/bench_exact.py: exact mode against the default, on a corpus export."""

from __future__ import annotations

import sys

from scripts._bench import environment as env

sys.path.insert(0, str(env.ROOT / "scripts"))
import bench_exact  # noqa: E402  (a script, imported from its folder)

EXPORT = env.ROOT / "tests" / "fixtures" / "exports" / "genai-llama-int4"


def test_the_arms_run_and_exact_batches_as_alone(capsys):
    assert bench_exact.main(["--model", str(EXPORT), "--rounds", "1", "--lengths", "17,33",
                             "--new-tokens", "4", "--batch", "3", "--batch-lengths", "9,21",
                             "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| TTFT at 33 tokens (s) |" in out and "| 3 slots, 9-21 tokens (tok/s) |" in out
    assert "batched equals alone (tokens and logprobs) for 3-3 of 3 requests" in out
