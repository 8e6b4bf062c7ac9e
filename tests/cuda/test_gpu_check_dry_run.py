"""scripts/gpu_check.sh --dry-run: the GPU check's whole sequence, on CPU."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_prints_the_table_last_and_writes_the_logs(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "TMPDIR": str(tmp_path)}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run",
                             "--python", sys.executable], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("check "))):]
    rows = {line[:30].strip(): line[30:].split(None, 1) for line in table[1:]}
    for check in ("greedy tokens cpu vs device", "greedy tokens graphs off vs on",
                  "second pass (replay) vs first", "cache thrash (cpu)"):
        assert rows[check][0] == "ok", table
    assert "5/5 prompts identical" in rows["greedy tokens cpu vs device"][1]
    assert rows["TTFT / decode, graphs on"][0] == "info"
    assert {path.name for path in out.iterdir()} >= {"gpu_check.log", "cache_thrash.log",
                                                     "results.json"}
    assert "greedy tokens equal in all three modes: True" in (out / "cache_thrash.log").read_text()
    assert not list(tmp_path.glob("gpu-check-work.*")), "the work folder is left behind"


def test_unknown_argument_is_refused(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--fast"],
                            capture_output=True, text=True, timeout=30,
                            env={**os.environ, "OUT": str(tmp_path)})
    assert result.returncode == 2
    assert "unknown argument --fast" in result.stderr
