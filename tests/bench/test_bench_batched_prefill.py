"""scripts/bench_batched_prefill.py: prompts arriving together, batched prefill or not."""

from __future__ import annotations

import json
import sys

import pytest

from scripts._bench import environment as env

sys.path.insert(0, str(env.ROOT / "scripts"))
import bench_batched_prefill  # noqa: E402  (a script, imported from its folder)

EXPORT = env.ROOT / "tests" / "fixtures" / "exports" / "genai-llama-fp32"


def test_the_arms_batch_as_named_and_give_the_same_tokens(tmp_path):
    assert bench_batched_prefill.main([
        "--model", str(EXPORT), "--prompts", "4", "--shortest", "20", "--longest", "100",
        "--new-tokens", "4", "--repetitions", "1", "--chunk-size", "32",
        "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "batched_prefill_genai-llama-fp32.json").read_text())
    assert data["prompts"] == [20, 47, 73, 100]
    runs = {arm: arm_runs[0] for arm, arm_runs in data["runs"].items()}
    assert runs["batched"]["forwards"]["prefill several slots"] >= 1
    assert runs["one per forward"]["forwards"]["prefill several slots"] == 0
    # Every prompt's chunks run in some forward: fewer forwards when batched.
    assert (runs["batched"]["forwards"]["prefill one slot"]
            + runs["batched"]["forwards"]["prefill several slots"]
            < runs["one per forward"]["forwards"]["prefill one slot"])
    # float32: a batched chunk gives the logits of the same chunk run alone.
    assert runs["batched"]["tokens"] == runs["rule"]["tokens"] == runs["one per forward"]["tokens"]
    assert all(len(tokens) == 4 for tokens in runs["rule"]["tokens"])
    assert all(0 < run["all_first_s"] <= run["all_done_s"] for run in runs.values())


@pytest.mark.parametrize("argv", [["--prompts", "0"], ["--shortest", "50", "--longest", "10"],
                                  ["--model", "no-such-model"]])
def test_bad_arguments_are_one_error_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_batched_prefill.main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("error:") == 1
