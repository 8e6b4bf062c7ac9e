"""`onnx-chunk generate` and `onnx-chunk demo` through the CLI entry point."""

import json

import pytest

from onnx_chunk.cli import main
from onnx_chunk.runtime import load


def _json_lines(out):
    return [json.loads(line) for line in out.strip().splitlines()]


def test_generate_json_matches_the_api(reference_model, capsys):
    path = reference_model("base")
    prompt = list(range(3, 45))
    code = main(["generate", str(path), "--ids", ",".join(map(str, prompt)),
                 "--max-new-tokens", "5", "--chunk-size", "16", "--provider", "cpu",
                 "--capacity", "128", "--json"])
    assert code == 0
    (entry,) = _json_lines(capsys.readouterr().out)
    expected = load(path, provider="cpu", capacity=128, chunk_size=128,
                    padding=False).open_sequence().generate(prompt, 5)
    assert entry["tokens"] == expected
    assert entry["prompt_tokens"] == 42
    assert [rows for rows, _ in entry["chunks"]] == [16, 16, 10]
    assert entry["ttft_s"] > 0 and entry["decode_tokens_per_s"] > 0
    stats = entry["stats"]
    assert {"compiles", "hits", "evictions", "variants", "widths"} <= set(stats)
    assert stats["compiles"] == len(stats["widths"]) == stats["variants"]


def test_ids_file_runs_every_prompt_in_one_runtime(reference_model, tmp_path, capsys):
    ids = tmp_path / "prompts.txt"
    ids.write_text("1 2 3 4 5\n\n6,7, 8\n1 2 3 4 5\n")
    code = main(["generate", str(reference_model("base")), "--ids-file", str(ids),
                 "--max-new-tokens", "3", "--provider", "cpu", "--capacity", "64", "--json",
                 "--chunk-size", "8"])
    assert code == 0
    entries = _json_lines(capsys.readouterr().out)
    assert [entry["prompt_tokens"] for entry in entries] == [5, 3, 5]
    assert entries[0]["tokens"] == entries[2]["tokens"]
    compiles = [entry["stats"]["compiles"] for entry in entries]
    hits = [entry["stats"]["hits"] for entry in entries]
    assert compiles[2] == compiles[1] and hits[2] > hits[1] > hits[0]


def test_text_output_and_options(reference_model, capsys):
    code = main(["generate", str(reference_model("base")), "--random-prompt", "40", "--seed",
                 "2", "--max-new-tokens", "2", "--provider", "cpu", "--capacity", "64",
                 "--chunk-size", "16", "--no-padding", "--no-specialize"])
    assert code == 0
    out = capsys.readouterr().out
    assert "padding off" in out and "prompt 0 (40 tokens)" in out
    assert "widths dynamic" in out


@pytest.mark.parametrize("args, message", [
    ([], "exactly one of --ids, --ids-file, --random-prompt"),
    (["--ids", "1,2", "--random-prompt", "3"], "exactly one"),
    (["--ids", "1,x"], "expected integers"),
    (["--ids", "1,999"], "outside the vocabulary"),
    (["--ids", "1,2", "--capacity", "4", "--max-new-tokens", "9"], "CapacityError|positions"),
])
def test_generate_errors_are_one_line(reference_model, capsys, args, message):
    argv = ["generate", str(reference_model("base")), "--provider", "cpu"] + args
    if "--max-new-tokens" not in args:
        argv += ["--max-new-tokens", "2"]
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0
    assert __import__("re").search(message, err)


def test_missing_model_file(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "none.onnx"), "--ids", "1",
                 "--max-new-tokens", "1", "--provider", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_demo_runs_and_checks_against_one_forward(tmp_path, capsys):
    code = main(["demo", "--prompt-tokens", "150", "--chunk-size", "64", "--max-new-tokens",
                 "4", "--provider", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    # The CPU default (one session, no padding), then the per-width variants with the ladder.
    assert "== one shape-generic session (provider default)" in out
    assert "150 tokens -> chunks 64, 64, 22\n" in out
    assert "== per-width variants" in out
    assert "157 tokens -> chunks 64, 64, 29->44" in out  # padded up the ladder 22, 44, 64
    assert out.count("greedy tokens equal a whole-prompt forward") == 2
    assert "new compiles 0" in out
    assert (tmp_path / "converted" / "model.onnx").is_file()


@pytest.mark.parametrize("flag, specialize, widths, padding", [
    ([], False, ["dynamic"], "off"),
    (["--specialize"], True, [1, 6, 16], "repeat"),  # 18 tokens: 16, then 2 padded to 6
])
def test_generate_takes_the_providers_specialisation_default(reference_model, capsys, flag,
                                                             specialize, widths, padding):
    code = main(["generate", str(reference_model("base")), "--ids", "3,4,5,6,7,8,9,10,11,12,"
                 "13,14,15,16,17,18,19,20", "--max-new-tokens", "3", "--chunk-size", "16",
                 "--provider", "cpu", "--capacity", "128", "--json", *flag])
    assert code == 0
    (entry,) = _json_lines(capsys.readouterr().out)
    stats = entry["stats"]
    assert stats["specialize"] is specialize and stats["weights_shared"] is specialize
    assert stats["widths"] == widths and stats["padding"] == padding
    assert stats["weights_bytes"] > 0


def test_generate_speculative_gives_the_plain_tokens_and_counts_drafts(capsys):
    from tests.exports.corpus import ROOT

    folder = ROOT / "genai-phi3-fp32"
    argv = ["generate", str(folder), "--random-prompt", "30", "--seed", "1",
            "--max-new-tokens", "150", "--provider", "cpu", "--chunk-size", "16", "--json",
            "--eos-token-id", "0"]
    assert main(argv) == 0
    (plain,) = _json_lines(capsys.readouterr().out)
    for batch in ("1", "2"):
        assert main(argv + ["--speculative", "prompt-lookup", "--batch", batch]) == 0
        (entry,) = _json_lines(capsys.readouterr().out)
        assert entry["tokens"] == plain["tokens"]
        stats = entry["stats"]
        assert stats["speculative"] == "prompt-lookup"
        assert 0 < stats["accepted_tokens"] <= stats["draft_tokens"]
        assert plain["stats"]["speculative"] is None


def test_generate_speculative_is_refused_for_a_decoder_with_recurrent_state(
        reference_model, capsys):
    code = main(["generate", str(reference_model("conv_hybrid")), "--ids", "1,2",
                 "--max-new-tokens", "2", "--provider", "cpu", "--speculative",
                 "prompt-lookup"])
    assert code == 2
    assert "recurrent state" in capsys.readouterr().err
