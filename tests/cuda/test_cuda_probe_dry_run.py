"""scripts/cuda_probe.py --dry-run: the probe's table on CPU, and its rows for an import or a
model build that fails."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROWS = ("environment", "model build", "memory, graphs off (rss)", "memory, graphs on (rss)",
        "captures per user run", "rerun after release", "run from another thread",
        "memory for 50 captures", "node placement", "replay vs uncaptured (prefill)",
        "replay vs uncaptured (decode)", "decode tokens/s")


def _probe(tmp_path, *args, pythonpath=""):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (pythonpath, str(ROOT))))}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "cuda_probe.py"),
                             "--dry-run", "--out", str(tmp_path), *args], capture_output=True,
                            text=True, env=env, timeout=240)
    lines = result.stdout.strip().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("check ")))
    table = lines[start:]
    assert start + len(table) == len(lines)  # the table ends the output
    return result, {line[:32].strip(): line[32:].split(None, 1) for line in table[1:]}


def test_the_dry_run_prints_every_row(tmp_path):
    result, rows = _probe(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(rows) == set(ROWS), rows
    assert rows["replay vs uncaptured (decode)"][0] == "ok"
    assert rows["replay vs uncaptured (prefill)"][0] == "ok"
    assert "0 Memcpy" in rows["node placement"][1]


def test_a_failed_import_is_the_one_row(tmp_path):
    fake = tmp_path / "fake" / "onnxruntime"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("simulated: no libcublasLt.so.12")\n')
    result, rows = _probe(tmp_path, pythonpath=str(fake.parent))
    assert result.returncode == 1
    assert rows == {"import": ["FAIL", "ImportError: simulated: no libcublasLt.so.12"]}


def test_a_failed_model_build_is_a_row(tmp_path):
    result, rows = _probe(tmp_path, "--preset", "no-such-preset")
    assert result.returncode == 1
    assert list(rows) == ["environment", "model build"]
    assert rows["model build"][0] == "FAIL" and "no-such-preset" in rows["model build"][1]


def test_the_probe_stays_under_200_lines():
    # Issue 29: a probe short enough to read before the GPU it runs on is lent.
    assert len((ROOT / "scripts" / "cuda_probe.py").read_text().splitlines()) < 200
