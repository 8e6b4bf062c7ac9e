"""The benchmark harness's pure parts, and one onnx-chunk measurement on the tiny decoder."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

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


def test_the_engine_benchmark_quick_mode_runs_every_part(tmp_path):
    """scripts/bench_engine.py --quick: every part on the tiny decoder, one round; the
    single-request part compares this checkout with itself as the baseline."""
    import json
    import subprocess

    script = env.ROOT / "scripts" / "bench_engine.py"
    result = subprocess.run([sys.executable, str(script), "--quick", "--no-genai", "--out",
                             str(tmp_path), "--baseline", str(env.ROOT)], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "batched (batch 4)" in (tmp_path / "engine_throughput_quick.md").read_text()
    assert "admission of a 300-token prompt" in (tmp_path / "engine_stall_quick.md").read_text()
    data = json.loads((tmp_path / "engine_throughput_quick.json").read_text())
    batched, alone = data["throughput"]["batched"][0], data["throughput"]["batch 1"][0]
    assert batched["tokens"] == alone["tokens"] and len(batched["tokens"]) == 6
    assert batched["rows_per_decode_step"] > 1
    assert alone["decode_forwards"] == 6 * 7 and batched["decode_forwards"] < 6 * 7
    stall = json.loads((tmp_path / "engine_stall_quick.json").read_text())
    assert stall["stall"]["chunked"][0]["chunks"] == 10

    memory = json.loads((tmp_path / "engine_memory_quick.json").read_text())["runs"]
    assert set(memory["load"]) == {"onnx-chunk"}
    load, imported = memory["load"]["onnx-chunk"][0], memory["import"]["onnx-chunk"][0]
    assert 0 < load["startup_s"] < load["ready_s"] < load["first_token_s"]
    assert load["ready_s"] == pytest.approx(load["startup_s"] + load["import_s"]
                                            + load["load_s"])
    assert load["first_token_s"] == pytest.approx(load["ready_s"] + load["to_first_token_s"])
    assert len(load["tokens"]) == 4 and imported["tokens"] == []
    assert load["peak_rss_mb"] >= load["rss_ready_mb"] > imported["rss_started_mb"] > 5
    assert set(load["modules"]) == {"started", "imported", "ready", "first_token", "generated"}
    assert load["modules"]["started"] == []
    assert "genai left out" in (tmp_path / "engine_memory_quick.md").read_text()

    single = json.loads((tmp_path / "engine_single_quick.json").read_text())
    assert single["baseline"] == str(env.ROOT)
    # The baseline runs its own conversion of the source model, in a folder of its own.
    baseline_model = Path(single["models"]["baseline"])
    assert baseline_model.is_relative_to(tmp_path / "models" / env.ROOT.name)
    assert baseline_model.is_file() and single["models"]["current"] != str(baseline_model)
    for path in ("generate", "submit"):
        current, baseline = single["runs"][path]["current"], single["runs"][path]["baseline"]
        assert [len(result["tokens"]) for result in current[0]] == [8, 8]
        assert current[0][1]["tokens"] == baseline[0][1]["tokens"]
        assert all(result["ttft_s"] > 0 and result["decode_tokens_per_s"] > 0
                   for result in current[0] + baseline[0])
    assert "tokens identical" in (tmp_path / "engine_single_quick.md").read_text()

    probe = json.loads((tmp_path / "engine_prefill_batching_quick.json").read_text())
    assert set(probe["seconds"]) == {"2x32", "4x10", "decode"}
    table = (tmp_path / "engine_prefill_batching_quick.md").read_text()
    assert "[2, 32] against 2 x [1, 32]" in table
    assert "throughput part, batch 1: decode phase" in table


def test_the_engine_benchmark_skips_the_single_part_without_a_baseline(tmp_path):
    import subprocess

    script = env.ROOT / "scripts" / "bench_engine.py"
    result = subprocess.run([sys.executable, str(script), "--quick", "--part", "single", "--out",
                             str(tmp_path), "--no-genai"], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "single-request part skipped: no --baseline PATH" in result.stdout
    assert not (tmp_path / "engine_single_quick.json").exists()
    refused = subprocess.run([sys.executable, str(script), "--quick", "--part", "single",
                              "--baseline", str(tmp_path), "--out", str(tmp_path)],
                             capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2
    assert "holds no onnx_chunk/__init__.py" in refused.stderr


def test_the_single_request_child_refuses_an_onnx_chunk_from_outside_its_checkout(
        reference_model, tmp_path):
    """A checkout without onnx_chunk/ lets the child import the installed one: refused."""
    from scripts._bench import engine_single

    with pytest.raises(ChildFailed, match="not from the checkout"):
        engine_single.run_in_checkout(tmp_path.resolve(), {
            "model": str(reference_model("base")), "path": "generate",
            "prompts": [seeded_prompt(12, 256)], "new_tokens": 2, "chunk_size": 8,
            "capacity": 16})


def test_the_load_worker_runs_genai_without_importing_onnx_chunk(reference_model, peer_python):
    child = run_child(env.worker_argv(peer_python, "load_worker", {
        "system": "genai", "mode": "load", "model": str(reference_model("base")),
        "prompt": seeded_prompt(12, 256), "new_tokens": 3, "chunk_size": 8}), timeout_s=120)
    stages = child.payload["stages"]
    assert list(stages) == ["started", "imported", "ready", "first_token", "generated"]
    moments = [child.started_at] + [stage["at"] for stage in stages.values()]
    assert moments == sorted(moments)
    assert all(stage["modules"] == [] for stage in stages.values())
    assert 1 <= len(child.payload["tokens"]) <= 3


def test_forward_flops_count_every_weight_once_per_row_and_causal_keys():
    from onnx_chunk.models.config import config_for
    from scripts._bench.flops import (
        attention_flops_per_key,
        forward_flops,
        generation_flops,
        linear_flops_per_row,
    )

    for config in (config_for("bench"), config_for("tiny"), config_for("tiny", conv_layers=(0,))):
        h = config.hidden_size
        # Every weight but the embedding table and the norms is one multiply-add per row.
        matrices = (config.parameter_count() - config.vocab_size * h
                    - 2 * h * config.num_layers - h)
        assert linear_flops_per_row(config) == 2 * matrices
        # A prompt costs the same however it is chunked (causal attention).
        assert forward_flops(config, 900) == (forward_flops(config, 512)
                                              + forward_flops(config, 388, past=512))
        assert forward_flops(config, 8, batch=3) == 3 * forward_flops(config, 8)
        assert (forward_flops(config, 1, past=40) - forward_flops(config, 1)
                == 40 * attention_flops_per_key(config))
    tiny = config_for("tiny")
    # 2 attention layers x (QK^T + AV) x 4 heads x 16 per key; rows 3 see 1 + 2 + 3 keys.
    assert attention_flops_per_key(tiny) == 2 * 2 * 2 * 4 * 16
    assert forward_flops(tiny, 3) == 3 * linear_flops_per_row(tiny) + 6 * 512
    prefill, decode = generation_flops(tiny, 10, 4)
    assert prefill == forward_flops(tiny, 10)
    assert decode == sum(forward_flops(tiny, 1, past=past) for past in (10, 11, 12))
    with pytest.raises(ValueError):
        forward_flops(tiny, 0)


def test_the_speculative_benchmark_quick_mode_runs_every_part(tmp_path, reference_model):
    """scripts/bench_speculative.py --quick on the tiny decoder: every part, one round, the
    greedy tokens of both systems identical."""
    import json
    import subprocess

    folder = str(reference_model("base").parent)
    script = env.ROOT / "scripts" / "bench_speculative.py"
    result = subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path),
                             "--model", folder, "--hit-model", folder], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "speculative_quick.json").read_text())
    assert data["random"]["identical"] and data["hits"]["identical"]
    assert set(data["verify_cost"]["times"]) == {"decode", "k=1", "k=4"}
    assert {"own forwards", "decode"} <= set(data["engine_verify"]["seconds"])
    assert "verify k=4 (5 rows)" in (tmp_path / "speculative_quick.md").read_text()


def test_the_speculative_benchmark_samples_the_hits_part_with_the_fields_given(
        tmp_path, reference_model):
    """--hit-sampling: both systems sample with those fields (a seed per round and prompt), the
    tokens are not compared, each system's share continuing the period is."""
    import json
    import subprocess

    folder = str(reference_model("base").parent)
    script = env.ROOT / "scripts" / "bench_speculative.py"
    result = subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path),
                             "--part", "hits", "--hit-model", folder, "--hit-prompts",
                             "periodic", "--hit-sampling", "temperature=1.5,top_k=8"],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    hits = json.loads((tmp_path / "speculative_quick.json").read_text())["hits"]
    assert hits["sampling"] == {"temperature": 1.5, "top_k": 8} and hits["identical"] is None
    # Sampled: the two systems draw from the same distribution with other random streams, so
    # their tokens part somewhere (greedy gives the same tokens: the quick-mode test above).
    assert hits["tokens_equal"] is False
    assert set(hits["copied"]) == {"prompt-lookup", "plain"}
    assert set(hits["continues_period"]) == {"prompt-lookup", "plain"}
    report = (tmp_path / "speculative_quick.md").read_text()
    assert "sampled: temperature=1.5,top_k=8" in report and "goal >= 1.3x" in report


def test_the_speculative_benchmark_counts_tokens_that_copy_what_followed_last_time():
    sys.path.insert(0, str(env.ROOT / "scripts"))
    from bench_speculative import copied_tokens

    # after 2, 3 as before (copied); after 3, 9 where 4 came before; after 9, which never came
    # before, 4; after 4, 5 as before (copied)
    assert copied_tokens([1, 2, 3, 4, 5, 2], [3, 9, 4, 5]) == 2
    assert copied_tokens([7], [7, 7, 7]) == 2 and copied_tokens([], []) == 0
    assert copied_tokens([], [5, 5]) == 0  # no history before the first: nothing to copy


def test_the_speculative_benchmark_periodic_prompts_repeat_a_block_of_distinct_ids():
    """--hit-model copy-fp32's prompts: a seeded block of P distinct ids (past the special
    tokens) repeated 1.5 to 2 times, the same every run."""
    sys.path.insert(0, str(env.ROOT / "scripts"))
    from bench_speculative import QUICK, hit_prompts, periodic_prompt

    for period in (8, 12, 40, 48):
        prompt = periodic_prompt(period, 512)
        block = prompt[:period]
        assert len(set(block)) == period and min(block) >= 8 and max(block) < 512
        assert period * 3 // 2 <= len(prompt) <= period * 2
        assert prompt == [block[index % period] for index in range(len(prompt))]
        assert prompt == periodic_prompt(period, 512)
    labels = [label for label, _ in hit_prompts("periodic", QUICK, 512)]
    assert labels == [f"{len(periodic_prompt(p, 512))} (period {p})" for p in QUICK["hit_periods"]]
    assert [label for label, _ in hit_prompts("random", QUICK, 512)] == ["16"]
    # copyq05's vocabulary is qwen05's: the prompts keep to the ids it was trained on
    wide = periodic_prompt(400, 151936)
    assert len(set(wide[:400])) == 400 and max(wide) < 512


@pytest.mark.parametrize("given", ["0", "8,505", "8,x", ""])
def test_the_speculative_benchmark_refuses_periods_the_ids_cannot_fill(given, capsys):
    sys.path.insert(0, str(env.ROOT / "scripts"))
    from bench_speculative import main as bench_main

    with pytest.raises(SystemExit) as stopped:
        bench_main(["--hit-periods", given, "--part", "hits", "--quick"])
    assert stopped.value.code == 2
    assert "--hit-periods" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["bench_engine.py", "bench_speculative.py",
                                    "bench_logprobs.py", "bench_structured.py"])
def test_a_script_that_measures_no_int4_bench_decoder_refuses_variant(script):
    """--variant int4 on a script that would measure fp32 anyway: refused, not ignored."""
    import subprocess

    result = subprocess.run([sys.executable, str(env.ROOT / "scripts" / script), "--quick",
                             "--variant", "int4"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--variant" in result.stderr, result.stderr


def test_the_verification_cost_alternates_forward_by_forward():
    """verify-cost runs every system once per cycle, in an order that rotates, so each
    verification has a decode step of its own moment to be divided by."""
    sys.path.insert(0, str(env.ROOT / "scripts"))
    from bench_speculative import cycle_ratios, forward_schedule

    plan = {"ks": [1, 4], "forwards": 2}
    schedule = list(forward_schedule(plan, rounds=2))
    cycles = [schedule[index:index + 3] for index in range(0, len(schedule), 3)]
    assert len(cycles) == 4
    assert all(sorted(cycle) == [("decode", 1), ("k=1", 2), ("k=4", 5)] for cycle in cycles)
    assert [cycle[0][0] for cycle in cycles] == ["decode", "k=1", "k=4", "decode"]
    # a slow moment slows its cycle's decode step and verification alike
    times = {"decode": [1.0, 2.0, 1.0], "k=4": [1.5, 3.0, 1.2]}
    assert cycle_ratios(times, "k=4") == "1.50x (1.20-1.50)"


def test_the_speculative_benchmark_measures_a_model_name_converted_and_a_folder_as_given(
        tmp_path, monkeypatch):
    """A benchmark model name is measured as users serve it (convert's defaults, into --out);
    an export folder runs as given."""
    sys.path.insert(0, str(env.ROOT / "scripts"))
    import bench_speculative

    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "genai_config.json").write_text("{}")
    out = tmp_path / "out"
    assert bench_speculative.model_to_measure(str(folder), out) == ("export", folder.resolve())
    converted = []

    def convert(out_folder, name, source, chunk_size):
        converted.append((out_folder, name, source, chunk_size))
        return out_folder / "models" / f"{name}-converted-{chunk_size}" / "model.onnx"

    monkeypatch.setattr(bench_speculative.env, "named_export", lambda value: (value, folder))
    monkeypatch.setattr(bench_speculative.env, "converted_export", convert)
    assert bench_speculative.model_to_measure("qwen05-int4", out) == (
        "qwen05-int4", out / "models" / "qwen05-int4-converted-512")
    assert converted == [(out, "qwen05-int4", folder, 512)]


def test_the_speculative_benchmark_refuses_periods_the_hit_model_cannot_hold(capsys):
    """A period needs as many distinct ids as it is long, and two periods plus the new tokens
    must fit the capacity: else one error line and exit 2 before anything runs."""
    sys.path.insert(0, str(env.ROOT / "scripts"))
    from bench_speculative import QUICK, hit_prompts

    # QUICK: capacity 256, 32 new tokens; ids from 8 up to the vocabulary (at most 512)
    for periods, vocab, words in (([60], 64, "the model has 56"), ([120], 512, "capacity 256")):
        with pytest.raises(SystemExit) as stopped:
            hit_prompts("periodic", dict(QUICK, hit_periods=periods), vocab)
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --hit-periods") and words in err, err
    assert len(hit_prompts("periodic", dict(QUICK, hit_periods=[56]), 64)) == 1  # at the edges
    assert len(hit_prompts("periodic", dict(QUICK, hit_periods=[112]), 512)) == 1


@pytest.mark.parametrize("argv, words", [
    (["--hit-periods", "16", "--part", "random"], "applies to --part hits"),
    (["--hit-model", "copy-fp32", "--part", "verify-cost"], "applies to --part hits"),
    (["--hit-periods", "16", "--hit-prompts", "random", "--part", "hits"], "periodic prompts"),
    (["--hit-sampling", "temperature=1", "--part", "random"], "applies to --part hits"),
    (["--hit-sampling", "temperature=3", "--part", "hits"], "temperature must be"),
    (["--hit-sampling", "seed=3", "--part", "hits"], "'seed' is not a numeric Sampling field"),
    (["--hit-sampling", "top_k=two", "--part", "hits"], "is not top_k=INT"),
    (["--hit-sampling", "min_tokens=1.5", "--part", "hits"], "is not min_tokens=INT"),
    (["--hit-sampling", "constraint=1", "--part", "hits"], "not a numeric Sampling field"),
])
def test_the_speculative_benchmark_refuses_hit_options_it_would_ignore(argv, words, capsys):
    sys.path.insert(0, str(env.ROOT / "scripts"))
    from bench_speculative import main as bench_main

    with pytest.raises(SystemExit) as stopped:
        bench_main([*argv, "--quick"])
    assert stopped.value.code == 2
    assert words in capsys.readouterr().err
