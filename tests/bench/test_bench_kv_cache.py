"""scripts/bench_kv_cache.py decode: the caches and onnxruntime-genai timed on one prompt file."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from scripts._bench import environment as env

SCRIPT = env.ROOT / "scripts" / "bench_kv_cache.py"
EXPORT = env.ROOT / "tests" / "fixtures" / "exports" / "genai-llama-fp32"


def _run(*argv: str, env_vars: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=600, check=False, env={**os.environ, **(env_vars or {})})


def test_decode_times_onnx_chunk_and_genai_in_the_same_rounds(peer_python, tmp_path):
    done = _run("decode", str(EXPORT), "--positions", "40", "--rounds", "2", "--genai",
                str(EXPORT), "--genai-venv", str(peer_python.parents[1]),
                env_vars={"TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    measured = [line for line in lines if re.match(r"\s+40\s+(float32|genai)\s+[\d.]+ tok/s", line)]
    # Two rounds, each system once a round, in the order given.
    assert [line.split()[1] for line in measured] == ["float32", "genai"] * 2
    medians = [line for line in lines if line.startswith("median")]
    assert len(medians) == 2 and medians[1].endswith("genai-llama-fp32")
    assert all(float(line.split()[2]) > 0 for line in measured)
    # The prompt file the systems read is removed.
    assert not list(tmp_path.glob("bench_kv_prompt_*"))


def test_genai_needs_a_genai_folder(tmp_path):
    done = _run("decode", str(EXPORT), "--positions", "40", "--genai", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.count("error:") == 1 and "no genai_config.json" in done.stderr


def test_an_environment_arm_runs_its_child_with_the_variable_set(tmp_path):
    arm = f"{EXPORT}+ONNX_CHUNK_BENCH_PROBE=on"
    done = _run("decode", str(EXPORT), arm, "--positions", "40", "--rounds", "1",
                env_vars={"ONNX_CHUNK_BENCH_PROBE": "", "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    medians = [line for line in done.stdout.splitlines() if line.startswith("median")]
    # Two arms of one folder: the child of the second saw the variable (the parent checks the
    # value the child reports), the first the parent's own empty value.
    assert [line.split("  ")[-1].strip() for line in medians] == [
        "genai-llama-fp32", "genai-llama-fp32 +ONNX_CHUNK_BENCH_PROBE=on"]


def test_an_arm_of_no_folder_is_one_error_line(tmp_path):
    done = _run("decode", f"{tmp_path / 'absent'}+NAME=1", "--positions", "40")
    assert done.returncode == 2
    assert done.stderr.count("error:") == 1 and "no such folder" in done.stderr
