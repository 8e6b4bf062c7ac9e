"""scripts/gpu_check.sh --dry-run: the GPU check's whole sequence, on CPU."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

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
    parity = rows["greedy tokens cpu vs device"][1]
    assert "5/5 prompts identical" in parity and "float32 vs float16" in parity
    results = json.loads((out / "results.json").read_text())
    assert {label: run["dtype"] for label, run in results.items()} == {
        "cpu": "float32", "graphs off": "float16", "graphs on": "float16"}
    assert rows["TTFT / decode, graphs on"][0] == "info"
    assert {path.name for path in out.iterdir()} >= {"gpu_check.log", "cache_thrash.log",
                                                     "thrash_model.log", "results.json"}
    assert "float16" in (out / "thrash_model.log").read_text()
    assert "greedy tokens equal in all three modes: True" in (out / "cache_thrash.log").read_text()
    assert not list(tmp_path.glob("gpu-check-work.*")), "the work folder is left behind"


def test_unknown_argument_is_refused(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--fast"],
                            capture_output=True, text=True, timeout=30,
                            env={**os.environ, "OUT": str(tmp_path)})
    assert result.returncode == 2
    assert "unknown argument --fast" in result.stderr


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through it
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_parity_allows_float16_noise_and_near_ties_only():
    gpu_check = _gpu_check_module()
    logits = np.array([0.0, 5.0, 9.0, 9.01], np.float32)
    wide = np.array([0.0, 5.0, 9.0, 3.0], np.float32)
    cpu = gpu_check._Run("cpu", tokens=[[3, 1], [2, 0]], prompt_logits=[logits, wide])
    device = gpu_check._Run("graphs off", tokens=[[2, 1], [2, 0]],
                            prompt_logits=[logits + 0.02, wide - 0.05])
    passed, detail = gpu_check._parity(cpu, device)
    assert passed and "1 near ties" in detail and "first tokens 1/2" in detail
    device.prompt_logits[1] = wide + 0.2  # above 1e-2 of the largest logit, 9.01
    assert not gpu_check._parity(cpu, device)[0]
    device.prompt_logits[1] = wide
    device.tokens[1] = [3, 0]  # a clear winner (9 against 5) that changed is no tie
    passed, detail = gpu_check._parity(cpu, device)
    assert not passed and "first tokens 0/2" in detail
