"""scripts/bench_reuse.py: conversations with prefix reuse on and off, on a corpus export."""

from __future__ import annotations

import json
import sys

import pytest

from scripts._bench import environment as env

sys.path.insert(0, str(env.ROOT / "scripts"))
import bench_reuse  # noqa: E402  (a script, imported from its folder)

EXPORT = env.ROOT / "tests" / "fixtures" / "exports" / "genai-llama-fp32"


def test_reuse_on_a_float32_export_reuses_and_changes_no_token(tmp_path, capsys):
    out = tmp_path / "runs.json"
    assert bench_reuse.main([str(EXPORT), "--conversations", "2", "--turns", "2",
                             "--threads", "1", "--json", str(out)]) == 0
    assert "| greedy | 0/4 |" in capsys.readouterr().out
    runs = json.loads(out.read_text())["runs"]
    turns = [turn for mode in ("greedy", "seeded") for talk in runs[mode] for turn in talk]
    assert len(turns) == 8
    # A later turn reuses the earlier turn's prompt and answer; a fresh prefill reuses nothing.
    assert all(turn["reuse"]["cached"] > 0 for turn in turns if turn["turn"] > 1)
    assert all(turn["fresh"]["cached"] == 0 and turn["no reuse"]["cached"] == 0
               for turn in turns)
    assert all(turn["reuse"]["tokens"] == turn["no reuse"]["tokens"] == turn["fresh"]["tokens"]
               for turn in turns)
    assert max(turn["reuse_max_logprob_gap"] for turn in turns) < 1e-4


@pytest.mark.parametrize("argv", [["--turns", "0"], ["--seed", "-1"], ["--threads", "0"],
                                  ["no-such-model"], ["--resend", "4,x"], ["--resend", "0"],
                                  ["--resend", "100000"], ["--resend", "5", "--turns", "2"],
                                  ["--resend", "5", "--json", "out.json"]])
def test_bad_arguments_are_one_error_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_reuse.main([str(EXPORT), *argv] if argv[0].startswith("--") else argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("error:") == 1


def test_a_continuation_counts_the_earlier_run_and_refuses_overlap(tmp_path, capsys):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    assert bench_reuse.main([str(EXPORT), "--conversations", "1", "--turns", "2",
                             "--json", str(first)]) == 0
    capsys.readouterr()
    assert bench_reuse.main([str(EXPORT), "--conversations", "1", "--turns", "2", "--first", "1",
                             "--merge", str(first), "--json", str(second)]) == 0
    out = capsys.readouterr().out
    assert "| greedy | 0/4 | 0/2 |" in out
    assert "1 conversations from this run, 1 from 1 earlier" in out
    runs = json.loads(second.read_text())["runs"]
    assert [conv[0]["number"] for conv in runs["greedy"]] == [1]
    # The same conversation twice, or other settings, are refused.
    for argv in (["--first", "0"], ["--first", "1", "--max-tokens", "8"]):
        with pytest.raises(SystemExit) as exit_info:
            bench_reuse.main([str(EXPORT), "--conversations", "1", "--turns", "2", *argv,
                              "--merge", str(first)])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.count("error:") == 1


def test_exact_mode_on_an_int4_export_changes_no_number(capsys):
    int4 = EXPORT.parent / "genai-llama-int4"
    assert bench_reuse.main([str(int4), "--conversations", "2", "--turns", "3", "--exact",
                             "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| greedy | 0/6 |" in out and "| seeded | 0/6 |" in out


def test_a_resent_prompt_reuses_all_but_its_last_two_ids(capsys):
    int4 = EXPORT.parent / "genai-llama-int4"
    assert bench_reuse.main([str(int4), "--resend", "5,17", "--conversations", "2",
                             "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 5 | 0 of 4 | 3 |" in out and "| 17 | 0 of 4 | 15 |" in out
