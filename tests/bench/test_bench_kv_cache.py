"""scripts/bench_kv_cache.py: decode (the caches and onnxruntime-genai timed on one prompt file,
TTFT and decode ratios to the first folder), memory (KV bytes and peak RSS with the whole cache
resident) and profile (seconds per operator of one forward)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from onnx_chunk.cli import main
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
    summary = [line for line in lines if line.startswith("  TTFT")]
    assert len(summary) == 2 and summary[1].endswith("genai-llama-fp32")
    # The first system is the one the ratios are to.
    assert summary[0].split()[4] == "1.00x" and summary[0].split()[9] == "1.00x", summary[0]
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
    summary = [line for line in done.stdout.splitlines() if line.startswith("  TTFT")]
    # Two arms of one folder: the child of the second saw the variable (the parent checks the
    # value the child reports), the first the parent's own empty value.
    assert [line.split("  ")[-1].strip() for line in summary] == [
        "genai-llama-fp32", "genai-llama-fp32 +ONNX_CHUNK_BENCH_PROBE=on"]


def test_decode_gives_ttft_and_decode_ratios_at_each_prompt_length(tmp_path):
    done = _run("decode", str(EXPORT), str(EXPORT), "--positions", "20", "40", "--rounds", "1",
                env_vars={"TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    headers = [line for line in lines if re.match(r"\d+ positions, 1 rounds, load ", line)]
    assert [line.split()[0] for line in headers] == ["20", "40"]
    for header in headers:
        summary = lines[lines.index(header) + 1:lines.index(header) + 3]
        times = [re.match(r"\s+TTFT\s+([\d.]+) s .* ([\d.]+)x\s+decode\s+([\d.]+) tok/s "
                          r".* ([\d.]+)x", line) for line in summary]
        assert all(times), summary
        first, second = (match.groups() for match in times)
        assert first[1] == first[3] == "1.00"
        # The second folder's ratios are its medians over the first's, within what printing
        # rounds away (TTFT to the millisecond, a millisecond or two on this export).
        assert _within_rounding(float(second[1]), second[0], first[0]), (first, second)
        assert _within_rounding(float(second[3]), second[2], first[2]), (first, second)


def _within_rounding(ratio: float, numerator: str, denominator: str) -> bool:
    """Whether `ratio` (printed to 0.01) can be numerator / denominator before both were
    printed with the decimals they show."""
    step = 10.0 ** -len(numerator.partition(".")[2])
    low = max(float(numerator) - step / 2, 0.0) / (float(denominator) + step / 2)
    high = (float(numerator) + step / 2) / max(float(denominator) - step / 2, step / 10)
    return low - 0.005 <= ratio <= high + 0.005


def test_paired_alternates_the_folders_in_one_process_and_counts_equal_tokens(tmp_path):
    done = _run("decode", str(EXPORT), str(EXPORT), "--paired", "--piece", "16", "--positions",
                "40", "--rounds", "2", env_vars={"TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("40 positions, 2 rounds paired, load ") for line in lines)
    summary = [line for line in lines if line.startswith("  TTFT")]
    # The same folder twice: its greedy tokens equal the first's, all 33, in both rounds.
    assert len(summary) == 2 and all("equal 33/33" in line for line in summary), summary
    refused = _run("decode", str(EXPORT), f"{EXPORT}+NAME=1", "--paired", "--positions", "40")
    assert refused.returncode == 2
    assert refused.stderr.count("error:") == 1 and "--paired runs every folder" in refused.stderr


def test_profile_times_each_operator_of_one_forward(tmp_path):
    int8 = tmp_path / "kv8"
    assert main(["convert", str(EXPORT), "-o", str(int8), "--kv-dtype", "int8",
                 "--chunk-size", "64"]) == 0
    done = _run("profile", str(EXPORT), str(int8), "--positions", "24", "--rows", "40",
                "--repeats", "1", env_vars={"TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("40 rows after 24 positions")
    cells = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    # The float cache attends in its kernel; the int8 cache's 40-row forward in the If's
    # float branch (passes.kv_prefill), which quantizes the new rows and writes them.
    assert float(cells["GroupQueryAttention"][0]) > 0 and float(cells["If"][0]) == 0
    assert float(cells["If"][1]) > 0 and float(cells["ScatterND"][1]) > 0
    assert "forward" in cells and "load" in cells and float(cells["peak"][2]) > 0
    assert not list(tmp_path.glob("bench_kv_profile*"))


def test_kernel_times_one_attention_node_per_cache_type():
    done = _run("kernel", "--heads", "4:2:16", "--positions", "24", "--rows", "40",
                "--repeats", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("one GroupQueryAttention 4:2:16, 40 rows after 24 positions")
    rows = [re.match(r"\s+(\S+)\s+([\d.]+) ms \(.*\)\s+([\d.]+)x\s+([\d.]+) GMAC/s", line)
            for line in lines[1:]]
    assert all(rows) and [row[1] for row in rows] == [
        "float32", "int8", "int4", "int8t", "int8-noflash", "int8d", "int4d"]
    assert rows[0][3] == "1.00" and all(float(row[4]) > 0 for row in rows)


def test_an_arm_of_no_folder_is_one_error_line(tmp_path):
    done = _run("decode", f"{tmp_path / 'absent'}+NAME=1", "--positions", "40")
    assert done.returncode == 2
    assert done.stderr.count("error:") == 1 and "no such folder" in done.stderr


def test_memory_holds_every_kv_page_resident_as_a_full_cache_would(tmp_path):
    """The memory mode's peak RSS is a full cache's: every page of every sequence's KV is
    written before the requests (as llama.cpp clears its cache when it makes it), so a 4-token
    request leaves none of the capacity out; the child measures its KV pages with mincore."""
    int8 = tmp_path / "kv8"
    assert main(["convert", str(EXPORT), "-o", str(int8), "--kv-dtype", "int8",
                 "--chunk-size", "16"]) == 0
    done = _run("memory", str(EXPORT), str(int8), "--shape", "1x2048", "--shape", "3x1024")
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((EXPORT / "genai_config.json").read_text())["model"]["decoder"]
    per_position = (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                    * config["head_size"] * 4)
    rows = [re.match(r"\s*(\d+)x(\d+)\s+(\w+) KV\s+([\d.]+) MiB \((\d+)% resident\)\s+peak RSS"
                     r"\s+([\d.]+) MiB", line) for line in done.stdout.splitlines()]
    assert all(rows) and len(rows) == 4, done.stdout
    assert [(row[1], row[2], row[3]) for row in rows] == [
        ("1", "2048", "float32"), ("1", "2048", "int8"), ("3", "1024", "float32"),
        ("3", "1024", "int8")]
    for row in rows:
        slots, capacity, quarter = int(row[1]), int(row[2]), row[3] == "int8"
        kv_mib = slots * capacity * per_position / (4 if quarter else 1) / 2**20
        assert float(row[4]) == pytest.approx(kv_mib, abs=0.05)
        assert row[5] == "100"
        assert float(row[6]) > kv_mib
