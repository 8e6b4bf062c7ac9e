"""The benchmark harness's pure parts, and one onnx-chunk measurement on the tiny decoder."""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from scripts._bench import environment as env
from scripts._bench.child import ChildFailed, run_child
from scripts._bench.harness import (
    capped_lengths,
    format_value,
    interleaved_order,
    markdown_table,
    ratio,
    round_order,
    seeded_prompt,
    summarize,
    verdict,
)


def test_interleaving_runs_every_system_once_per_round_and_rotates_the_first():
    systems = ("a", "b", "c")
    order = interleaved_order(systems, 4)
    assert len(order) == 12
    for round_index in range(4):
        in_round = [system for index, system in order if index == round_index]
        assert sorted(in_round) == sorted(systems)
    assert [order[3 * r][1] for r in range(4)] == ["a", "b", "c", "a"]
    assert Counter(system for _, system in order) == {"a": 4, "b": 4, "c": 4}
    assert round_order(("x", "y"), 1) == ["y", "x"]


@pytest.mark.parametrize("systems, repetitions", [((), 3), (("a", "a"), 2), (("a",), 0)])
def test_interleaving_rejects_impossible_plans(systems, repetitions):
    with pytest.raises(ValueError):
        interleaved_order(systems, repetitions)


def test_summary_median_spread_and_ratio():
    summary = summarize([3.0, 1.0, 2.0, 10.0])
    assert (summary.n, summary.median, summary.low, summary.high) == (4, 2.5, 1.0, 10.0)
    assert summary.spread == pytest.approx(9.0 / 2.5)
    assert format_value(summarize([2.0, 2.2, 1.8]), 1) == "2.0 ±20%"
    assert ratio(summarize([4.0]), summarize([2.0])) == 2.0
    assert ratio(summarize([1.0]), summarize([0.0])) == float("inf")
    with pytest.raises(ValueError):
        summarize([])


def test_verdict_follows_the_direction_of_the_target():
    assert verdict(0.9, 1.0, higher_is_better=False) == "ok"
    assert verdict(1.1, 1.0, higher_is_better=False) == "MISS"
    assert verdict(1.1, 1.0, higher_is_better=True) == "ok"
    assert verdict(0.99, 1.0, higher_is_better=True) == "MISS"


def test_markdown_table_aligns_numbers_right_and_checks_row_width():
    text = markdown_table(["prompt", "ratio"], [[40, "1.2x"], [300, 0.5]])
    lines = text.splitlines()
    assert lines[0] == "| prompt | ratio |"
    assert lines[1] == "| ---: | --- |"
    assert lines[3] == "| 300 | 0.50 |"
    with pytest.raises(ValueError):
        markdown_table(["a", "b"], [[1]])


def test_prompts_are_seeded_and_lengths_capped_by_capacity():
    first = seeded_prompt(300, 32000)
    assert first == seeded_prompt(300, 32000)
    assert first != seeded_prompt(300, 32000, seed=1)
    assert len(first) == 300 and min(first) >= 3 and max(first) < 32000
    assert seeded_prompt(40, 32000) != first[:40]
    assert capped_lengths([40, 300, 4000, 5000], 4096, 32) == [40, 300, 4000, 4064]
    assert capped_lengths([40, 3000, 4000], 2048, 32) == [40, 2016]


def test_a_failing_child_is_reported_with_its_error():
    with pytest.raises(ChildFailed, match="boom"):
        run_child([sys.executable, "-c", "import sys; sys.exit('boom')"], timeout_s=30)


def test_one_onnx_chunk_measurement_on_the_tiny_decoder(reference_model):
    model = reference_model("base")
    prompt = seeded_prompt(20, 256)
    child = run_child(env.worker_argv(sys.executable, "chunk_worker", {
        "model": str(model), "prompts": [prompt], "new_tokens": 4, "chunk_size": 8,
        "eos": None}), timeout_s=120)
    result = child.payload["results"][0]
    assert result["prompt_tokens"] == 20
    assert len(result["tokens"]) == 4
    assert [rows for rows, _ in result["chunks"]] == [8, 8, 4]
    assert all(width >= rows for rows, width in result["chunks"])
    assert result["ttft_s"] > 0 and result["decode_tokens_per_s"] > 0
    assert child.peak_rss_mb > 10

    from onnx_chunk.models.reference import ReferenceDecoder

    assert result["tokens"] == ReferenceDecoder.from_model_dir(model.parent).greedy(prompt, 4)


def test_one_genai_measurement_on_the_tiny_decoder(reference_model, peer_python):
    python = peer_python
    model = reference_model("base")
    prompt = seeded_prompt(20, 256)
    child = run_child(env.worker_argv(python, "genai_worker", {
        "model": str(model.parent), "prompts": [prompt], "new_tokens": 4, "chunk_size": 8}),
        timeout_s=120)
    result = child.payload["results"][0]
    assert 1 <= len(result["tokens"]) <= 4
    assert result["ttft_s"] > 0

    from onnx_chunk.models.reference import ReferenceDecoder

    reference = ReferenceDecoder.from_model_dir(model.parent).greedy(prompt, 4)
    assert result["tokens"] == reference[:len(result["tokens"])]


def test_a_small_child_of_a_large_parent_reports_its_own_small_peak():
    """wait4's ru_maxrss starts from the parent's resident set at fork; VmHWM does not."""
    import numpy as np

    ballast = np.ones(400 * 2**20, dtype=np.uint8)  # 400 MiB resident in this process
    child = run_child([sys.executable, "-c", "print('{}')"], timeout_s=60)
    assert ballast.sum() > 0
    assert child.payload == {}
    assert 1 < child.peak_rss_mb < 100, child.peak_rss_mb


def test_the_engine_benchmark_quick_mode_runs_and_checks_its_tokens(tmp_path):
    """scripts/bench_engine.py --quick: the tiny decoder, one round, both tables."""
    import json
    import subprocess

    script = env.ROOT / "scripts" / "bench_engine.py"
    result = subprocess.run([sys.executable, str(script), "--quick", "--no-genai", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    table = (tmp_path / "engine_quick.md").read_text()
    assert "batched (batch 4)" in table and "admission of a 300-token prompt" in table
    data = json.loads((tmp_path / "engine_quick.json").read_text())
    batched, alone = data["throughput"]["batched"][0], data["throughput"]["batch 1"][0]
    assert batched["tokens"] == alone["tokens"] and len(batched["tokens"]) == 6
    assert batched["rows_per_decode_step"] > 1
    assert data["stall"]["chunked"][0]["chunks"] == 10
