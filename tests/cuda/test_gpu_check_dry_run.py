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
    for check in ("greedy tokens cpu vs device", "graphs off vs on",
                  "second pass (replay) vs first", "captures in pass 1", "captures in pass 2",
                  "captured widths = widths used", "second sequence", "node placement",
                  "graphs within the plan", "weights copies", "one session per model",
                  "engine at batch 8", "native folder from elsewhere", "cache thrash (cpu)"):
        assert rows[check][0] == "ok", table
    for check in ("onnxruntime", "providers", "preload_dlls", "libcudart", "gpu",
                  "cuda probe", "capture log lines", "memory graphs on (rss)",
                  "memory plan (rss)", "weights experiment", "bytes after load (rss)",
                  "bytes as widths arrive (rss)"):
        assert rows[check][0] == "info", table
    assert not [line for line in table if line.startswith("error")], table
    # The dry run's stand-in captures per width once in pass 1 and never after.
    assert "expected {1: 1, 11: 1, 32: 1}" in rows["captures in pass 1"][1]
    assert "0 captures" in rows["second sequence"][1]
    assert "1 sessions, 1 weights copies" in rows["one session per model"][1]
    assert "tokens equal graphs off" in rows["engine at batch 8"][1]
    assert "0 evictions" in rows["graphs within the plan"][1]
    assert "5/5 prompts' tokens equal the unwired" in rows["native folder from elsewhere"][1]
    assert lines.index(table[0]) == len(lines) - len(table)  # the table is printed last
    parity = rows["greedy tokens cpu vs device"][1]
    assert "5/5 prompts identical" in parity and "float32 vs float16" in parity
    results = json.loads((out / "results.json").read_text())
    assert {label: run["dtype"] for label, run in results.items()
            if "dtype" in run} == {"cpu": "float32", "graphs off": "float16",
                                   "graphs on": "float16", "plan": "float16"}
    assert (out / "ort-logs" / "graphs-on-pass1.log").is_file()
    assert rows["TTFT / decode, graphs on"][0] == "info"
    assert {path.name for path in out.iterdir()} >= {"gpu_check.log", "cache_thrash.log",
                                                     "thrash_model.log", "results.json"}
    assert "float16" in (out / "thrash_model.log").read_text()
    thrash = (out / "cache_thrash.log").read_text()
    assert "ok   last prefill logits agree across modes within the tolerance" in thrash
    assert not list(tmp_path.glob("gpu-check-work.*")), "the work folder is left behind"


def test_a_failing_step_is_one_error_row_and_the_table_still_ends_the_output(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run",
                             "--preset", "no-such-preset", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 1
    lines = result.stdout.strip().splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("check "))):]
    assert table[-1].startswith("error: models") and "FAIL" in table[-1]
    assert "onnxruntime" in table[1] and "error: models" in result.stderr
    assert (tmp_path / "table.txt").read_text().strip().splitlines() == table


def _sh_table(tmp_path, extra_env, *args):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "TMPDIR": str(tmp_path), **extra_env}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run",
                             "--python", sys.executable, *args], capture_output=True,
                            text=True, env=env, timeout=180)
    lines = result.stdout.strip().splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("check "))):]
    assert lines.index(table[0]) == len(lines) - len(table)  # the table is printed last
    return result, {line[:30].strip(): line[30:].split(None, 1) for line in table[1:]}


def test_a_failed_import_is_a_row_and_the_table_still_ends_the_output(tmp_path):
    fake = tmp_path / "fake" / "onnxruntime"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        'raise ImportError("simulated: libcudart.so.12: cannot open shared object file")\n')
    result, rows = _sh_table(tmp_path, {"PYTHONPATH": str(fake.parent)})
    assert result.returncode == 1
    assert rows["import"][0] == "FAIL" and "simulated: libcudart.so.12" in rows["import"][1]
    assert rows["thrash model build"][0] == "FAIL"
    assert "simulated" in rows["thrash model build"][1]
    assert rows["cache thrash (cpu)"] == ["FAIL", "not run: no thrash model"]


def test_a_failed_model_build_is_a_row_and_the_table_still_ends_the_output(tmp_path):
    result, rows = _sh_table(tmp_path, {"GPU_CHECK_THRASH_PRESET": "no-such-preset"},
                             "--preset", "no-such-preset")
    assert result.returncode == 1
    assert rows["error: models"][0] == "FAIL" and "no-such-preset" in rows["error: models"][1]
    assert rows["thrash model build"][0] == "FAIL"
    assert rows["cache thrash (cpu)"] == ["FAIL", "not run: no thrash model"]
    assert rows["onnxruntime"][0] == "info"  # the environment rows came before


def test_unknown_argument_is_refused(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--fast"],
                            capture_output=True, text=True, timeout=30,
                            env={**os.environ, "OUT": str(tmp_path)})
    assert result.returncode == 2
    assert "unknown argument --fast" in result.stderr


def _script_module(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through it
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_parity_allows_float16_noise_and_near_ties_only():
    gpu_check = _script_module("gpu_check")
    logits = np.array([0.0, 5.0, 9.0, 9.01], np.float32)
    wide = np.array([0.0, 5.0, 9.0, 3.0], np.float32)
    cpu = gpu_check.Run("cpu", tokens=[[3, 1], [2, 0]], prompt_logits=[logits, wide])
    device = gpu_check.Run("graphs off", tokens=[[2, 1], [2, 0]],
                            prompt_logits=[logits + 0.02, wide - 0.05])
    passed, detail = gpu_check.parity(cpu, device)
    assert passed and "1 near ties" in detail and "first tokens 1/2" in detail
    device.prompt_logits[1] = wide + 0.2  # above 1e-2 of the largest logit, 9.01
    assert not gpu_check.parity(cpu, device)[0]
    device.prompt_logits[1] = wide
    device.tokens[1] = [3, 0]  # a clear winner (9 against 5) that changed is no tie
    passed, detail = gpu_check.parity(cpu, device)
    assert not passed and "first tokens 0/2" in detail


def test_staging_installs_with_the_last_part_and_names_the_missing_ones(tmp_path, monkeypatch,
                                                                        capsys):
    stage = _script_module("stage_ort_gpu")
    monkeypatch.setattr(stage, "STAGE", tmp_path / "stage")
    monkeypatch.setattr(stage, "LANDING", tmp_path / "landing")
    installed = []
    monkeypatch.setattr(stage, "install", lambda: installed.append(True) or 0)
    stage.STAGE.mkdir()
    parts = []
    for index, data in enumerate((b"first", b"second", b"third")):
        part = stage.STAGE / f"part-{index:02d}"
        part.write_bytes(data)
        parts.append({"name": part.name, "sha256": stage.sha256_of(part), "bytes": len(data)})
    (stage.STAGE / "manifest.json").write_text(json.dumps(
        {"wheel": "w.whl", "sha256": "", "parts": parts}))
    assert stage.receive([str(stage.STAGE / "part-00")]) == 0
    assert "missing: part-01, part-02" in capsys.readouterr().out
    assert stage.receive([str(stage.STAGE / "part-02")], then_install=True) == 2
    captured = capsys.readouterr()
    assert "missing: part-01" in captured.out and "part-01" in captured.err and not installed
    assert stage.receive([str(stage.STAGE / "part-01")], then_install=True) == 0
    assert installed == [True]
    plan = stage.call_plan(["part-00", "part-01"])
    assert plan[-1].endswith("receive .stage/part-01 --install && bash scripts/gpu_check.sh'")
    assert "--install" not in plan[0]
