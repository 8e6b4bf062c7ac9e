"""scripts/gpu_first_run.sh --dry-run: every row of the first GPU run on CPU, with rows for a
simulated import failure, a simulated capture failure and a step that dies without a row; the
real run's own timeouts add up to under 10 minutes."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_first_run.sh"
STEP_ROWS = ("environment: onnxruntime", "environment: driver", "environment: libcudart",
             "version surface", "device identity: probe", "device identity: KV in place",
             "device identity: logits", "native chunks on the device",
             "concurrency: fallbacks", "concurrency: CUDA errors", "concurrency: logits")
PROBE_ROWS = ("environment", "model build", "replay vs uncaptured (decode)", "node placement")
CHECK_ROWS = ("gpu_check: greedy tokens cpu vs device", "gpu_check: engine at batch 8",
              "gpu_check: cache thrash (cpu)")


def _run(tmp_path, *args, pythonpath="", python=sys.executable):
    env = {**os.environ, "OUT": str(tmp_path / "logs"),
           "PYTHONPATH": os.pathsep.join(filter(None, (pythonpath,)))}
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--python", python, *args],
                            capture_output=True, text=True, env=env, timeout=600)
    lines = result.stdout.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("check ")))
    rows = {}
    for line in lines[start + 1:]:
        name, verdict, detail = re.match(r"(.+?)\s{2,}(ok|FAIL|info)\s+(.*)", line).groups()
        rows[name] = (verdict, detail)
    assert len(lines) == start + 1 + len(rows)  # the table ends the output
    return result, rows


def test_the_dry_run_prints_every_row(tmp_path):
    result, rows = _run(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert set(STEP_ROWS + PROBE_ROWS + CHECK_ROWS) <= set(rows), sorted(rows)
    assert not [name for name, (verdict, _) in rows.items() if verdict == "FAIL"]
    assert rows["device identity: KV in place"][1].startswith(
        "rows at seqlens_k changed in the owned KV buffer: [True, True]")
    assert rows["concurrency: fallbacks"][0] == "ok"


def test_a_simulated_capture_failure_is_a_failed_row(tmp_path):
    result, rows = _run(tmp_path, "--simulate", "capture-failure", "--only", "concurrency")
    assert result.returncode == 1
    assert {name.split(":")[0] for name in rows} == {"concurrency"}
    verdict, detail = rows["concurrency: fallbacks"]
    assert verdict == "FAIL" and "simulated: operation not permitted when stream is " \
        "capturing" in detail
    assert rows["concurrency: logits"][0] == "ok"  # the fallback ran the width uncaptured


def test_a_simulated_import_failure_is_a_row_per_step(tmp_path):
    fake = tmp_path / "fake" / "onnxruntime"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("simulated: no libcudart.so.13")\n')
    result, rows = _run(tmp_path, pythonpath=str(fake.parent))
    assert result.returncode == 1
    for step in ("environment", "surface", "identity", "native", "concurrency"):
        verdict, detail = rows[step]
        assert verdict == "FAIL" and detail == \
            "import: ImportError: simulated: no libcudart.so.13", (step, rows[step])
    assert rows["import"] == ("FAIL", "ImportError: simulated: no libcudart.so.13")
    assert rows["gpu_check: import"][0] == "FAIL"


def test_only_names_a_step(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--only", "environmen"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("error: --only environmen is no step (the steps: environment, "
                             "version surface, device identity, native chunks, concurrency, "
                             "cuda_probe.py, gpu_check.sh)\n")


def test_a_step_that_dies_without_a_row_is_a_row(tmp_path):
    result, rows = _run(tmp_path, python="/bin/false")
    assert result.returncode == 1
    for step in ("environment", "version surface", "device identity", "native chunks",
                 "concurrency", "cuda_probe.py"):
        verdict, detail = rows[step]
        assert verdict == "FAIL" and detail.startswith("status 1 after"), (step, detail)


def test_the_real_run_fits_in_ten_minutes_by_its_own_timeouts():
    text = SCRIPT.read_text()
    steps = re.findall(r'^  "([^|"]+)\|(\d+)\|', text, re.MULTILINE)
    assert [name for name, _ in steps] == [
        "environment", "version surface", "device identity", "native chunks", "concurrency",
        "cuda_probe.py", "gpu_check.sh"]
    kill_after = int(re.search(r"timeout --kill-after=(\d+)", text).group(1))
    assert sum(int(limit) + kill_after for _, limit in steps) < 600
