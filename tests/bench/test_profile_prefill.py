"""scripts/profile_prefill.py: the profile, the variants and a compare run on a corpus export."""

from __future__ import annotations

import errno
import json
import math
import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest

from scripts._bench import environment as env

sys.path.insert(0, str(env.ROOT / "scripts"))
import profile_prefill  # noqa: E402  (a script, imported from its folder)

EXPORT = env.ROOT / "tests" / "fixtures" / "exports" / "genai-llama-int4"


def test_projection_names_and_greedy_agreement():
    assert profile_prefill.projection("/model/layers.3/attn/qkv_proj/MatMul_Q4") == \
        "attn/qkv_proj"
    assert profile_prefill.projection("/model/layers.12/mlp/down_proj/MatMul") == \
        "mlp/down_proj"
    assert profile_prefill.projection("/lm_head/MatMul_Q4") == "lm_head"
    assert profile_prefill.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert profile_prefill.agreement([5], [5, 6]) == 1


def test_node_times_are_split_by_run():
    events = [{"cat": "Session", "name": "model_run", "ts": 0, "dur": 100},
              {"cat": "Session", "name": "model_run", "ts": 200, "dur": 100},
              {"cat": "Node", "name": "a_kernel_time", "ts": 10, "dur": 30,
               "args": {"op_name": "MatMulNBits"}},
              {"cat": "Node", "name": "a_fence_before", "ts": 9, "dur": 1, "args": {}},
              {"cat": "Node", "name": "a_kernel_time", "ts": 210, "dur": 50,
               "args": {"op_name": "MatMulNBits"}}]
    runs = profile_prefill.per_run_node_times(events)
    assert runs == [{"a": ("MatMulNBits", 30e-6)}, {"a": ("MatMulNBits", 50e-6)}]


def test_profile_names_every_projection_with_its_rate(capsys):
    assert profile_prefill.main(["profile", "--model", str(EXPORT), "--rows", "32",
                                 "--repeats", "1", "--peak-gflops", "100"]) == 0
    out = capsys.readouterr().out
    assert "| MatMulNBits |" in out and "| GroupQueryAttention |" in out
    for name in ("lm_head", "attn/qkv_proj", "attn/o_proj", "mlp/down_proj"):
        assert f"| {name} |" in out
    assert "block 32 level 4" in out
    # A verification's forward: rows after a past.
    assert profile_prefill.main(["profile", "--model", str(EXPORT), "--rows", "5", "--past",
                                 "40", "--repeats", "1", "--peak-gflops", "100",
                                 "--peak-read-gbs", "10"]) == 0
    assert "5 rows after 40 positions of past" in capsys.readouterr().out


def test_profile_counts_an_int8_folders_weights_and_their_read_rate(tmp_path, capsys):
    from onnx_chunk.cli import main as cli

    out = tmp_path / "int8"
    assert cli(["convert", str(EXPORT), "-o", str(out)]) == 0  # the int8 default
    capsys.readouterr()
    shapes = profile_prefill.matmul_shapes(out / "model.onnx", rows=1)
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    sizes = {tensor.name: math.prod(tensor.dims) for tensor in graph.initializer}
    int8 = [node for node in graph.node if node.op_type == "MatMulInteger"]
    assert int8 and all(shapes[node.name]["bits"] == 8 for node in int8)
    # Each weight: its int8 B (one byte a weight) and its float32 column scales.
    for node in int8:
        k, n = shapes[node.name]["K"], shapes[node.name]["N"]
        assert sizes[node.input[1]] == k * n
        assert shapes[node.name]["weight_bytes"] == k * n + 4 * n
    # A prefill's lm_head computes the last row alone (`logits_rows`): its flops are one row's.
    head = next(name for name in shapes if profile_prefill.projection(name) == "lm_head")
    last = profile_prefill.matmul_shapes(out / "model.onnx", rows=64, head_rows=1)
    k, n = last[head]["K"], last[head]["N"]
    assert last[head]["flops"] == 2 * k * n
    assert all(shape["flops"] == 2 * 64 * shape["K"] * shape["N"]
               for name, shape in last.items() if name != head)
    assert profile_prefill.main(["profile", "--model", str(out), "--rows", "1", "--repeats",
                                 "1", "--peak-gflops", "100", "--peak-read-gbs", "10"]) == 0
    printed = capsys.readouterr().out
    assert "read 10.0 GB/s (given)" in printed and "without the profiler" in printed
    assert "| weight GB/s | of read |" in printed
    assert "bits 8 block 0" in printed
    assert "logits of every row" in printed
    # A prefill as the runtime runs it: the lm_head computes the last row alone.
    assert profile_prefill.main(["profile", "--model", str(out), "--rows", "8", "--repeats",
                                 "1", "--peak-gflops", "100", "--peak-read-gbs", "10",
                                 "--logits-rows", "last"]) == 0
    assert "logits of the last row" in capsys.readouterr().out
    # A builder export has no rows to choose: refused in one line, before any timing.
    assert profile_prefill.main(["profile", "--model", str(EXPORT), "--rows", "8",
                                 "--peak-gflops", "100", "--peak-read-gbs", "10",
                                 "--logits-rows", "last"]) == 2
    assert "--logits-rows last" in capsys.readouterr().err


def test_the_loop_feeds_a_converted_graphs_logits_rows_as_the_runtime_does(tmp_path, capsys):
    from onnx_chunk.cli import main as cli

    out = tmp_path / "converted"
    assert cli(["convert", str(EXPORT), "-o", str(out), "-q"]) == 0
    session = _cpu_session(out / "model.onnx")
    genai = json.loads((out / "genai_config.json").read_text())["model"]
    ids = [5, 9, 17, 33, 65, 129]
    last = profile_prefill.Loop(session, genai, len(ids))
    every = profile_prefill.Loop(session, genai, len(ids))
    assert last.chooses_rows
    np.testing.assert_allclose(last.forward(ids, 0), every.forward(ids, 0, all_rows=True),
                               atol=1e-3)
    assert last.io.get_outputs()[-1].shape() == [1, 1, genai["vocab_size"]]  # one row bound
    builder = profile_prefill.Loop(_cpu_session(EXPORT / "model.onnx"), genai, len(ids))
    assert not builder.chooses_rows


def _cpu_session(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_the_read_peak_is_measured():
    assert profile_prefill.practical_read_peak(1, megabytes=16, repeats=1) > 0


def test_variants_change_the_graph_only_and_compare_measures_them(tmp_path, capsys):
    # A copy of the fixture: a variant hard-links its source's weights, and onnx.checker
    # refuses the source's weights while a second link to them exists.
    source = tmp_path / "source"
    shutil.copytree(EXPORT, source)
    level = tmp_path / "level0"
    rows = tmp_path / "lastrow"
    assert profile_prefill.main(["variant", "--model", str(source), "--out", str(level),
                                 "--accuracy-level", "0"]) == 0
    assert "hard link" in capsys.readouterr().out
    assert profile_prefill.main(["variant", "--model", str(source), "--out", str(rows),
                                 "--last-row-logits"]) == 0
    graph = onnx.load(str(level / "model.onnx"), load_external_data=False).graph
    levels = {attribute.i for node in graph.node if node.op_type == "MatMulNBits"
              for attribute in node.attribute if attribute.name == "accuracy_level"}
    assert levels == {0}
    # The weights are the original's file (hard link), not rewritten.
    assert os.path.samefile(level / "model.onnx.data", source / "model.onnx.data") or \
        (level / "model.onnx.data").read_bytes() == (source / "model.onnx.data").read_bytes()
    logits = next(value for value in onnx.load(str(rows / "model.onnx"),
                                               load_external_data=False).graph.output
                  if value.name == "logits")
    assert logits.type.tensor_type.shape.dim[1].dim_value == 1
    # The last-row variant's head computes one row at any row count: its flops are one row's.
    shapes = profile_prefill.matmul_shapes(rows / "model.onnx", rows=64)
    (head,) = [name for name in shapes if profile_prefill.projection(name) == "lm_head"]
    assert shapes[head]["flops"] == 2 * shapes[head]["K"] * shapes[head]["N"]
    full = profile_prefill.matmul_shapes(source / "model.onnx", rows=64)
    assert full[head]["flops"] == 64 * shapes[head]["flops"]
    capsys.readouterr()
    assert profile_prefill.main([
        "compare", "--model", str(source), "--candidate", f"lastrow={rows}",
        "--candidate", f"nospin={source},session.intra_op.allow_spinning=0,threads=1",
        "--lengths", "40", "--new-tokens", "4", "--rounds", "1", "--chunk-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "1-minute load average before each measurement" in out
    lines = {line.split("|")[2].strip(): line for line in out.splitlines()
             if line.startswith("| 40 |")}
    assert set(lines) == {"base", "lastrow", "nospin"}
    # The last row's logits are the full forward's last row: the same greedy tokens.
    assert lines["lastrow"].rstrip().endswith("| 4/4 |")
    assert lines["nospin"].rstrip().endswith("| 4/4 |")


def test_a_missing_model_is_one_error_line(tmp_path, capsys):
    assert profile_prefill.main(["profile", "--model", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1


def test_a_variant_with_nothing_to_change_is_refused(tmp_path, capsys):
    assert profile_prefill.main(["variant", "--model", str(EXPORT), "--out",
                                 str(tmp_path / "same")]) == 2
    assert "nothing to change" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["nameonly", "=folder"])
def test_a_malformed_candidate_is_refused(text, capsys):
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        profile_prefill.parse_candidate(text, None)


def test_paired_ratios_are_per_pair_and_best_over_best():
    ratios = profile_prefill.paired_ratios([1.0, 2.0, 4.0], [0.5, 1.0, 4.0])
    assert ratios["median"] == 0.5 and ratios["best"] == 0.5
    assert ratios["spread"] == pytest.approx((1.0 - 0.5) / 0.5)


def test_paired_and_kernel_runs_print_their_tables(tmp_path, capsys):
    source = tmp_path / "source"
    shutil.copytree(EXPORT, source)
    rows = tmp_path / "lastrow"
    assert profile_prefill.main(["variant", "--model", str(source), "--out", str(rows),
                                 "--last-row-logits"]) == 0
    capsys.readouterr()
    assert profile_prefill.main(["paired", "--model", str(source), "--candidate",
                                 f"lastrow={rows}", "--rows", "16", "--past", "8",
                                 "--pairs", "2", "--new-tokens", "4"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("| lastrow |"))
    assert "| 4/4 |" in line  # the last row's logits: the same greedy tokens
    assert profile_prefill.main(["kernel", "--shape", "64x96", "--rows", "8", "--repeats", "2",
                                 "--kernel", "4:32:4", "--kernel", "8:32:4", "--kernel",
                                 "32:0:0", "--kernel", "dq8", "--kernel", "rows8",
                                 "--int8-roof", "380"]) == 0
    out = capsys.readouterr().out
    for name in ("4-bit block 32 level 4", "8-bit block 32 level 4", "MatMul fp32",
                 "DynamicQuantizeMatMul int8", "per-row int8 (--int8-matmul)"):
        assert f"| 64 x 96 | {name} |" in out


@pytest.mark.parametrize("argv", [["kernel", "--kernel", "4:32"], ["kernel", "--shape", "896"],
                                  ["compare", "--model", str(EXPORT), "--lengths", "12,x"]])
def test_malformed_numbers_are_one_error_line(argv, capsys):
    assert profile_prefill.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1


def test_the_roofs_are_measured_with_the_widest_instructions_the_cpu_has(capsys):
    """`roof`: the C loop built at -march=native; AVX-512 VNNI where the CPU has it, and the
    rate of a thread within the machine's possible range (some G-ops/s, far below a TOP/s)."""
    import platform

    from scripts._bench import roof

    if platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"):
        pytest.skip("the roof loop is x86 (AVX2 or AVX-512); its ISA is read from /proc/cpuinfo")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on PATH")
    got = roof.measure(1, iterations=2_000_000)
    flags = open("/proc/cpuinfo").read().split()
    expected = ("avx512-vnni vpdpbusd" if {"avx512_vnni", "avx512bw"} <= set(flags)
                else "avx2 vpmaddubsw+vpmaddwd")
    assert got["int8_isa"] == expected
    assert got["fp32_isa"] == ("avx512f fma" if "avx512f" in flags else "avx2 fma")
    assert 1 < got["fp32_gflops"] < got["int8_gops"] < 2000
    assert profile_prefill.main(["roof", "--threads", "1"]) == 0
    table = capsys.readouterr().out
    assert f"| 1 | {expected} |" in table


def test_without_a_c_compiler_the_roof_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert profile_prefill.main(["roof"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: no C compiler (cc, gcc or clang) on PATH to build the roof loop")


no_amx_shim = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64"
    or not (shutil.which("cc") or shutil.which("gcc")),
    reason="the no-AMX shim is for Linux x86_64 with a C compiler")


@no_amx_shim
def test_the_no_amx_shim_refuses_the_tile_state_and_nothing_else(tmp_path):
    from scripts._bench.no_amx import ARCH_REQ_XCOMP_PERM, shim

    probe = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "SYS_ARCH_PRCTL, GET_XCOMP_SUPP = 158, 0x1021\n"
        "mask = ctypes.c_ulong(0)\n"
        f"asked = libc.syscall(SYS_ARCH_PRCTL, {ARCH_REQ_XCOMP_PERM}, 18)\n"
        "refused = ctypes.get_errno()\n"
        "other = libc.syscall(SYS_ARCH_PRCTL, GET_XCOMP_SUPP, ctypes.byref(mask))\n"
        "print(asked, refused, other)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**os.environ, "LD_PRELOAD": str(shim(tmp_path))}, check=True)
    asked, refused, other = done.stdout.split()
    assert (int(asked), int(refused), int(other)) == (-1, errno.EPERM, 0)


@no_amx_shim
def test_a_kernel_run_without_amx_says_so():
    done = subprocess.run(
        [sys.executable, str(env.ROOT / "scripts" / "profile_prefill.py"), "kernel", "--no-amx",
         "--shape", "64x96", "--rows", "8", "--repeats", "2", "--kernel", "dq8"],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "AMX refused (no-AMX shim)" in done.stdout
    assert "| 64 x 96 | DynamicQuantizeMatMul int8 |" in done.stdout

