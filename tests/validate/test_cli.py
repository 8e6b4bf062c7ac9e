"""`onnx-chunk validate`: exit codes, the table, --json, --junit, --skip and progress."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET

import pytest

from onnx_chunk.cli import main

from .conftest import CHUNK
from .mutations import copy_model


@pytest.fixture
def base(reference_model):
    return reference_model("base")


def _run(capsys, *args):
    capsys.readouterr()
    code = main(["validate", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_good_model_folder_exits_0_with_a_table(converted_model, capsys):
    code, out, _ = _run(capsys, converted_model("base").parent, "--provider", "cpu",
                        "--lengths", "3,17", "--new-tokens", 2)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["check", "result", "reason"]
    assert lines[-1] == "15 passed, 0 failed, 0 skipped"
    assert any(line.startswith("numerics.logits") and " passed " in line for line in lines)


def test_json_is_one_object_with_model_checks_summary(base, capsys):
    code, out, _ = _run(capsys, base, "--json", "--chunk-size", CHUNK, "--provider", "cpu",
                        "--lengths", "3,9", "--new-tokens", 2, "--skip", "cache")
    data = json.loads(out)
    assert code == 0 and set(data) == {"schema", "model", "checks", "summary"}
    assert data["model"] == str(base)
    assert data["summary"] == {"passed": 11, "failed": 0, "skipped": 4, "ok": True}
    check = next(item for item in data["checks"] if item["name"] == "numerics.greedy_tokens")
    assert set(check) == {"name", "group", "outcome", "reason", "seconds", "details"}
    assert check["details"]["lengths"] == [3, 9]
    assert [len(tokens) for tokens in check["details"]["tokens"]["whole"]] == [2, 2]
    skipped = [item["name"] for item in data["checks"] if item["outcome"] == "skipped"]
    assert skipped == ["structure.metadata", "structure.ladder", "cache.second_pass",
                       "cache.variant_cap"]


def test_junit_is_written_atomically_and_lists_failures(base, tmp_path, capsys):
    model = copy_model(base, tmp_path / "model")
    (model.parent / "model.onnx.data").unlink()
    report = tmp_path / "out" / "report.xml"
    code, out, _ = _run(capsys, model, "--junit", report, "--chunk-size", CHUNK)
    assert code == 1
    assert any(line.split()[:2] == ["structure.external_data", "failed"]
               for line in out.splitlines())
    assert sorted(path.name for path in report.parent.iterdir()) == ["report.xml"]
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite.get("tests") == "15" and suite.get("failures") == "2"
    assert suite.get("skipped") == "8"
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    failure = cases["structure.external_data"].find("failure")
    assert failure is not None and "missing" in failure.get("message")
    assert cases["numerics.logits"].find("skipped") is not None
    assert cases["structure.gqa"].find("failure") is None
    assert cases["structure.gqa"].get("classname") == "onnx_chunk.structure"


def test_skip_takes_groups_and_checks(base, capsys):
    code, out, _ = _run(capsys, base, "--json", "--skip", "numerics", "--skip",
                        "cache.second_pass", "--skip", "variant_cap", "--skip", "checker")
    data = json.loads(out)
    reasons = {item["name"]: item["reason"] for item in data["checks"]}
    assert code == 0
    assert all(reasons[name] == "skipped (--skip)" for name in (
        "numerics.greedy_tokens", "numerics.logits", "numerics.kv_prefix",
        "cache.second_pass", "cache.variant_cap", "structure.checker"))
    assert reasons["structure.gqa"] == "2 GroupQueryAttention node(s)"


def test_a_junit_report_that_cannot_be_written_leaves_no_folder(base, tmp_path, capsys):
    report = tmp_path / "new" / ("r" * 250 + ".xml")  # too long a name for its staging
    code, out, err = _run(capsys, base, "--junit", report, "--skip", "numerics", "--skip",
                          "cache")
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "JUnit report" in err and not (tmp_path / "new").exists()


@pytest.mark.parametrize("args, message", [
    (["--skip", "nothing"], "--skip 'nothing' names no check"),
    (["--lengths", "5,x"], "--lengths"),
    (["--lengths", "4000"], "leave no room"),
    (["--new-tokens", "0"], "--new-tokens"),
])
def test_wrong_arguments_exit_2(base, capsys, args, message):
    code, _, err = _run(capsys, base, *args)
    assert code == 2 and message in err


def test_unreadable_models_exit_2(tmp_path, base, capsys):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07 this is not a protobuf \xff\xff\xff")
    truncated = copy_model(base, tmp_path / "truncated")
    truncated.write_bytes(truncated.read_bytes()[:200])
    folder = tmp_path / "two"
    folder.mkdir()
    (folder / "a.onnx").write_bytes(b"")
    (folder / "b.onnx").write_bytes(b"")
    for path, message in ((garbage, "not a readable ONNX protobuf"),
                          (truncated, "truncated"),
                          (tmp_path / "absent.onnx", "does not exist"),
                          (folder, "cannot tell which model")):
        code, out, err = _run(capsys, path)
        assert code == 2, (path, err)
        assert out == "" and err.startswith("error: ") and message in err
        assert len(err.strip().splitlines()) == 1


def test_progress_goes_to_stderr_when_asked(base, capsys):
    code, out, err = _run(capsys, base, "--progress", "--chunk-size", CHUNK, "--lengths", "2,9",
                          "--skip", "structure")
    assert code == 0 and "validating" in err and "validating" not in out
    _, _, quiet = _run(capsys, base, "--chunk-size", CHUNK, "--lengths", "2", "--skip",
                       "structure", "--skip", "cache")
    assert "validating" not in quiet


@pytest.mark.parametrize("name", ["model.onnx", "model.onnx.data", "genai_config.json"])
def test_junit_refuses_to_overwrite_a_file_of_the_model(base, tmp_path, capsys, name):
    model = copy_model(base, tmp_path / "model")
    before = {path.name: path.read_bytes() for path in model.parent.iterdir()}
    for given in (model, model.parent):
        code, out, err = _run(capsys, given, "--junit", model.parent / name, "--skip",
                              "numerics", "--skip", "cache")
        assert code == 2 and out == "" and err.startswith("error: ") and name in err, err
        assert len(err.strip().splitlines()) == 1
    assert {path.name: path.read_bytes() for path in model.parent.iterdir()} == before


def test_junit_refuses_a_folder(base, tmp_path, capsys):
    code, _, err = _run(capsys, base, "--junit", tmp_path, "--skip", "numerics")
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--new-tokens", "1000000"], "generate at most 2047"),
    (["--seed", "-1"], "--seed"),
    (["--max-input-len", "8"], "static decoders only"),
    (["--decode-model", "decode.onnx"], "static decoders only"),
])
def test_impossible_or_misplaced_options_exit_2_with_one_line(base, capsys, args, message):
    code, out, err = _run(capsys, base, *args)
    assert code == 2 and out == "", out
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_validate_refuses_a_path_that_is_not_utf8(base, tmp_path, capsys):
    folder = tmp_path / "x\udcff"
    model = copy_model(base, folder)
    code, out, err = _run(capsys, model, "--skip", "numerics", "--skip", "cache")
    assert code == 2 and out == ""
    assert "not valid UTF-8" in err and len(err.strip().splitlines()) == 1


def test_validate_folder_refuses_a_filename_outside_it(base, tmp_path, capsys):
    model = copy_model(base, tmp_path / "inner" / "model")
    config = model.parent / "genai_config.json"
    document = json.loads(config.read_text())
    document["model"]["decoder"]["filename"] = "../../outside.onnx"
    config.write_text(json.dumps(document))
    shutil.copy(model, tmp_path / "outside.onnx")
    code, out, err = _run(capsys, model.parent)
    assert code == 2 and out == ""
    assert "outside the model's folder" in err and len(err.strip().splitlines()) == 1


def test_exact_with_a_tolerance_is_refused(capsys):
    from tests.cli_output import one_error_line
    from tests.exports.corpus import ROOT

    assert main(["validate", str(ROOT / "genai-llama-fp32"), "--exact", "--atol", "0.1"]) == 2
    one_error_line(capsys, "--exact", "--atol 0.1")


def test_threads_set_every_session_the_checks_run(base, capsys, monkeypatch):
    from onnx_chunk.validate import runs

    asked = []
    load = runs.load

    def recording(*args, **kwargs):
        asked.append(kwargs.get("intra_op_threads"))
        return load(*args, **kwargs)

    monkeypatch.setattr(runs, "load", recording)
    code, _, err = _run(capsys, base, "--threads", "1", "--chunk-size", CHUNK, "--lengths",
                        "2,9")
    assert code == 0, err
    # Reference, floor pairs, the perturbed forward, chunked, padded, cache and engine.
    assert len(asked) >= 6 and set(asked) == {1}
    code, _, err = _run(capsys, base, "--threads", "0")
    assert code == 2 and "--threads" in err
