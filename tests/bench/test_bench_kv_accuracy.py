"""scripts/bench_kv_accuracy.py: perplexity and greedy agreement of float32, int8 and int4 KV
caches, on a corpus export (quick mode); the text decoder's data rules (held-back file,
missing folder)."""

from __future__ import annotations

import json
import math
import sys

import pytest

from scripts._bench import environment as env

sys.path.insert(0, str(env.ROOT / "scripts"))
import bench_kv_accuracy  # noqa: E402  (a script, imported from its folder)
import make_bench_models  # noqa: E402
from _bench import text_decoder  # noqa: E402

EXPORT = env.ROOT / "tests" / "fixtures" / "exports" / "genai-llama-fp32"
TRAIN = ("The licensee may copy and distribute verbatim copies of the program's source code "
         "as received, in any medium, provided that each copy carries a notice.\n") * 6
HELD = ("You may reproduce and distribute copies of the work or derivative works thereof in "
        "any medium, with or without modifications, in source or object form.\n") * 4


def _texts(tmp_path):
    held, train = tmp_path / "held.txt", tmp_path / "train.txt"
    held.write_text(HELD)
    train.write_text(TRAIN)
    return ["--held-out", str(held), "--train-text", str(train)]


def test_quick_run_measures_every_cache_against_float32(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert bench_kv_accuracy.main([str(EXPORT), "--quick", "--out", str(tmp_path / "models"),
                                   "--json", str(out), "--threads", "1",
                                   *_texts(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "CPU: " in printed and "load average" in printed
    assert "| float32 | " in printed and "| int4 per-tensor | " in printed
    report = json.loads(out.read_text())
    results = report["results"]
    assert list(results) == [name for name, _, _ in bench_kv_accuracy.CACHES]
    assert [results[name]["kv_dtype"] for name in results] == [
        "float32", "int8", "int8", "int4", "int4"]
    # int8 holds a quarter of float32's bytes, int4 an eighth.
    assert results["int8 per-channel"]["kv_bytes"] * 4 == results["float32"]["kv_bytes"]
    assert results["int4 per-tensor"]["kv_bytes"] * 8 == results["float32"]["kv_bytes"]
    base = results["float32"]
    # The reference agrees with itself: chunked all-row prefill gives the argmax decode gave.
    assert base["row_agreement"] == 1.0 and base["greedy_agreement"] == 1.0
    assert base["first_divergence"] == [None, None]
    assert base["tokens_scored"] == 4 * 31
    assert all(len(path) == 16 for path in base["free"])
    for result in results.values():
        assert math.isfinite(result["perplexity"]) and result["perplexity"] > 1.0
        assert 0.0 <= result["greedy_agreement"] <= 1.0
    # Each converted folder really is a separate conversion with its own scales.
    assert len({results[name]["perplexity"] for name in results}) > 1
    clipping = report["clipping"]
    assert len(clipping) == 2 * 2  # a key and a value cache per layer, 2 layers
    assert all(0 <= each["channels_over"] <= each["channels"] == 2 * 16
               and each["worst_channel"] >= each["tensor"] > 0 for each in clipping.values())
    assert "Held-back text past the calibrated ranges: per channel" in printed
    calibration = (tmp_path / "models" / "calibration.txt").read_text()
    assert "licensee" in calibration and "reproduce" not in calibration
    assert "--kv-scales per-tensor" in report["convert_commands"]["int4 per-tensor"]


@pytest.mark.parametrize("argv", [["--window", "1"], ["--prompts", "0"], ["--threads", "0"],
                                  ["no-such-model"]])
def test_bad_arguments_are_one_error_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_kv_accuracy.main([str(EXPORT), *argv] if argv[0].startswith("--") else argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("error:") == 1


def test_an_empty_held_out_file_is_one_error_line(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(SystemExit) as exit_info:
        bench_kv_accuracy.main([str(EXPORT), "--held-out", str(empty), "--out",
                                str(tmp_path)])
    assert exit_info.value.code == 2
    assert "is empty" in capsys.readouterr().err


def test_the_held_out_licence_is_never_training_text(tmp_path):
    (tmp_path / text_decoder.HELD_OUT_FILE).write_text(HELD)
    (tmp_path / "GPL-3").write_text(TRAIN)
    (tmp_path / "GPL").symlink_to(tmp_path / "GPL-3")
    (tmp_path / "Apache").symlink_to(tmp_path / text_decoder.HELD_OUT_FILE)
    train, held = text_decoder.texts(tmp_path)
    assert list(train) == ["GPL"]  # read once, under its first name; no link to the held-out
    assert held == HELD
    assert not any("reproduce" in line for line in text_decoder.training_lines(tmp_path))


def test_windows_cover_the_tokens_without_overlap():
    ids = list(range(70))
    cut = text_decoder.windows(ids, 32)
    assert [len(each) for each in cut] == [32, 32, 6]
    assert sum(cut, []) == ids
    assert text_decoder.windows(list(range(65)), 32) == [list(range(32)), list(range(32, 64))]


def test_a_missing_licence_folder_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(text_decoder, "LICENSES", tmp_path / "absent")
    with pytest.raises(SystemExit) as exit_info:
        make_bench_models.make_trained_source("text", tmp_path / "source")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "absent" in err
    assert not (tmp_path / "source").exists()
    with pytest.raises(SystemExit) as exit_info:
        bench_kv_accuracy.main([str(EXPORT), "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("error:") == 1


def test_text_fp32_is_a_known_name_whose_shape_the_builder_exports_as_is():
    from _bench.models import BenchModelMissing, parse_name

    assert parse_name("text-fp32") == ("text", "fp32")  # trained here: fp32 and int4 exports
    assert parse_name("text-int4") == ("text", "int4")
    for bad in ("text-fp16", "text-q8_0"):
        with pytest.raises(BenchModelMissing, match="unknown benchmark model"):
            parse_name(bad)
    # No projection of vocab_size outputs (the builder would take it for the lm_head), and
    # fewer KV heads than query heads (GroupQueryAttention groups them).
    assert make_bench_models.lm_head_clash(text_decoder.CONFIG) == []
    assert text_decoder.KV_HEADS < text_decoder.HEADS
    assert text_decoder.HEADS * text_decoder.HEAD_DIM == text_decoder.HIDDEN
