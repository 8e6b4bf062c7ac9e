"""`validate --reference`: a quantized KV cache against the float cache of the same weights.

The subjects are `convert --kv-dtype int8` folders of real exports (the corpus's builder
folders, copied first); the references their float originals, unconverted or converted.
"""

from __future__ import annotations

import json
import math
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_chunk.cli import main
from onnx_chunk.errors import ConfigError
from onnx_chunk.models.static_decoder import build_static_decoder
from onnx_chunk.runtime import load
from onnx_chunk.validate import (
    Outcome,
    ValidationOptions,
    agreement,
    numerics,
    resolve_skip,
    validate_model,
    validator,
)
from onnx_chunk.validate.prompts import seeded_prompt
from tests.exports.corpus import fixtures

LENGTHS = (3, 17)
NEW = 4
# Only the reference group runs: the other groups are tested elsewhere.
ONLY = ("--skip", "numerics", "--skip", "cache", "--skip", "engine")
QUICK = ("--provider", "cpu", "--lengths", ",".join(map(str, LENGTHS)), "--new-tokens", NEW)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """`folder(name, kv_dtype=None)`: a copy of the corpus export `name`, or its conversion
    with an int8 / int4 cache (`kv_dtype`, default calibration) or a float one ("float")."""
    root = tmp_path_factory.mktemp("agreement")
    corpus = {fixture.name: fixture for fixture in fixtures()}
    made: dict[tuple[str, str | None], Path] = {}

    def make(name: str, kv_dtype: str | None = None) -> Path:
        if (name, None) not in made:
            made[(name, None)] = corpus[name].copy_to(root / name)
        if (name, kv_dtype) not in made:
            out = root / f"{name}-{kv_dtype}"
            extra = [] if kv_dtype == "float" else ["--kv-dtype", kv_dtype]
            assert main(["convert", str(made[(name, None)]), "-o", str(out), *extra]) == 0
            made[(name, kv_dtype)] = out
        return made[(name, kv_dtype)]

    return make


def _cli(capsys, subject, *args):
    capsys.readouterr()
    code = main(["validate", str(subject), *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _checks(out: str) -> dict:
    return {check["name"]: check for check in json.loads(out)["checks"]}


def _greedy(folder: Path, capacity: int, chunk_size: int, length: int,
            fed: list[int] | None = None) -> tuple[list[int], list[np.ndarray]]:
    """The greedy tokens (the argmax of each step) and each step's logits of a seeded prompt:
    free-running, or teacher-forced on `fed` (step i decodes fed[i], not its own argmax)."""
    with load(folder, provider="cpu", capacity=capacity, chunk_size=chunk_size) as runtime:
        ids = seeded_prompt(runtime.stats.vocab_size, length, 0)
        with runtime.open_sequence() as sequence:
            rows = [sequence.prefill(ids).copy()]
            for step in range(NEW - 1):
                token = int(np.argmax(rows[-1])) if fed is None else fed[step]
                rows.append(sequence.decode(token))
    return [int(np.argmax(row)) for row in rows], rows


@pytest.mark.parametrize("name", ["genai-llama-fp32", "genai-qwen3-int4"])
def test_an_int8_cache_against_its_float_original_reports_what_it_costs(folder, capsys, name):
    subject, original = folder(name, "int8"), folder(name)
    code, out, _ = _cli(capsys, subject, "--json", "--reference", original, *QUICK, *ONLY)
    checks = _checks(out)
    assert code == 0
    logits, tokens = checks["reference.max_logits_diff"], checks["reference.greedy_agreement"]
    assert logits["outcome"] == tokens["outcome"] == "passed"
    assert "(no threshold)" in logits["reason"] and "(no threshold)" in tokens["reason"]
    worst = logits["details"]["max_abs_difference"]
    # int8 rounding moves the logits: a zero would mean the models were not both run.
    assert math.isfinite(worst) and worst > 0.0
    details = tokens["details"]
    assert 0.0 <= details["agreement"] <= 1.0 and details["positions"] == len(LENGTHS) * NEW
    assert details["agreement"] == details["agreed"] / details["positions"]
    # The numbers, recomputed here from runtimes of the two folders.
    capacity, width = details["capacity"], details["chunk_size"]
    expected_worst, agreed = 0.0, 0
    for index, length in enumerate(LENGTHS):
        wanted, reference_rows = _greedy(original, capacity, width, length)
        assert details["tokens"]["reference"][index] == wanted
        forced, rows = _greedy(subject, capacity, width, length, fed=wanted)
        assert details["tokens"]["subject"][index] == forced
        expected_worst = max(expected_worst, max(float(np.abs(row.astype(np.float64) - ref).max())
                                                 for row, ref in zip(rows, reference_rows)))
        agreed += sum(own == token for own, token in zip(forced, wanted))
        # The first teacher-forced disagreement is where free-running generation parts.
        free, _ = _greedy(subject, capacity, width, length)
        parted = next((step for step, (own, token) in enumerate(zip(free, wanted))
                       if own != token), None)
        assert details["first_divergence"][index] == parted
    assert worst == pytest.approx(expected_worst, rel=1e-6)
    assert details["agreed"] == agreed


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_model_against_itself_differs_by_nothing(folder, capsys, kv_dtype):
    model = folder("genai-llama-fp32", kv_dtype)  # unconverted, then converted
    code, out, _ = _cli(capsys, model, "--json", "--reference", model, *QUICK, *ONLY,
                        "--reference-max-logits-diff", 0, "--reference-min-agreement", 1)
    checks = _checks(out)
    assert code == 0
    assert checks["reference.max_logits_diff"]["details"]["max_abs_difference"] == 0.0
    assert checks["reference.max_logits_diff"]["reason"].startswith("max |logits diff| 0 <= 0;")
    details = checks["reference.greedy_agreement"]["details"]
    assert details["agreement"] == 1.0 and details["first_divergence"] == [None, None]


def test_a_converted_float_reference_is_compared_too(folder, capsys):
    code, out, _ = _cli(capsys, folder("genai-llama-fp32", "int8"), "--json", "--reference",
                        folder("genai-llama-fp32", "float"), *QUICK, *ONLY)
    worst = _checks(out)["reference.max_logits_diff"]["details"]["max_abs_difference"]
    assert code == 0 and math.isfinite(worst) and worst > 0.0


def test_thresholds_fail_past_them_and_pass_within(folder, capsys, tmp_path):
    subject, original = folder("genai-llama-fp32", "int8"), folder("genai-llama-fp32")
    report = tmp_path / "report.xml"
    code, out, _ = _cli(capsys, subject, "--reference", original, *QUICK, *ONLY,
                        "--reference-max-logits-diff", 1e-9, "--junit", report)
    assert code == 1
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:-1]}
    assert rows["reference.max_logits_diff"] == "failed"
    assert rows["reference.greedy_agreement"] == "passed"
    cases = {case.get("name"): case
             for case in ET.parse(report).getroot().iter("testcase")}
    failure = cases["reference.max_logits_diff"].find("failure")
    assert failure is not None and "> 1e-09" in failure.get("message")
    assert json.loads(failure.text)["threshold"] == 1e-9
    assert cases["reference.max_logits_diff"].get("classname") == "onnx_chunk.reference"
    code, out, _ = _cli(capsys, subject, "--json", "--reference", original, *QUICK, *ONLY,
                        "--reference-max-logits-diff", 1e6, "--reference-min-agreement", 0)
    assert code == 0 and all(check["outcome"] == "passed" for check in _checks(out).values()
                             if check["group"] == "reference")


def test_a_minimum_agreement_fails_below_it(folder, capsys):
    # Other random weights over the same vocabulary: greedy tokens part at once.
    code, out, _ = _cli(capsys, folder("genai-llama-fp32"), "--json", "--reference",
                        folder("genai-qwen3-fp32"), *QUICK, *ONLY,
                        "--reference-min-agreement", 1)
    check = _checks(out)["reference.greedy_agreement"]
    assert code == 1 and check["outcome"] == "failed"
    assert check["details"]["agreement"] < 1.0 and " < 1;" in check["reason"]
    assert check["details"]["threshold"] == 1
    assert _checks(out)["reference.max_logits_diff"]["outcome"] == "passed"


def test_skip_reference_works_like_the_other_groups(folder, capsys):
    model = folder("genai-llama-fp32")
    code, out, _ = _cli(capsys, model, "--json", "--reference", model, *QUICK, *ONLY,
                        "--skip", "reference")
    checks = _checks(out)
    assert code == 0
    assert [checks[name]["reason"] for name in ("reference.max_logits_diff",
                                                "reference.greedy_agreement")] == [
        "skipped (--skip)", "skipped (--skip)"]
    code, out, _ = _cli(capsys, model, "--json", "--reference", model, *QUICK, *ONLY,
                        "--skip", "greedy_agreement")
    checks = _checks(out)
    assert code == 0 and checks["reference.greedy_agreement"]["outcome"] == "skipped"
    assert checks["reference.max_logits_diff"]["outcome"] == "passed"
    # Without --reference the group is not listed.
    code, out, _ = _cli(capsys, model, "--json", *QUICK, *ONLY)
    assert code == 0 and not any(name.startswith("reference.") for name in _checks(out))


def test_the_reference_runs_first_and_no_two_runtimes_are_held_at_once(folder, monkeypatch):
    subject, original = folder("genai-llama-fp32", "int8"), folder("genai-llama-fp32")
    loaded = []
    real = agreement.load_runtime

    def tracked(model_path, *args, **kwargs):
        assert all(runtime.closed for _, runtime in loaded), "a runtime was still loaded"
        runtime = real(model_path, *args, **kwargs)
        loaded.append((model_path, runtime))
        return runtime

    for module in (agreement, numerics, validator):
        monkeypatch.setattr(module, "load_runtime", tracked)
    report = validate_model(subject, ValidationOptions(
        provider="cpu", lengths=LENGTHS, new_tokens=NEW, reference=original))
    assert not report.failed
    paths = [path for path, _ in loaded]
    assert paths[0].parent == original and paths[-1].parent == subject
    assert len(paths) == 7  # reference, numerics' three and floor, served, subject
    assert all(runtime.closed for _, runtime in loaded)


def test_a_reference_with_less_room_sets_the_capacity_of_both(folder, capsys, tmp_path):
    short = _with_context_length(folder("genai-llama-fp32"), tmp_path / "short", 24)
    code, out, _ = _cli(capsys, folder("genai-llama-fp32", "int8"), "--json", "--reference",
                        short, *QUICK, *ONLY)
    details = _checks(out)["reference.max_logits_diff"]["details"]
    assert code == 0 and details["capacity"] == 24 and details["chunk_size"] == 24


def _with_context_length(original: Path, target: Path, positions: int) -> Path:
    shutil.copytree(original, target)
    config = json.loads((target / "genai_config.json").read_text())
    config["model"]["context_length"] = positions
    config["search"]["max_length"] = positions
    (target / "genai_config.json").write_text(json.dumps(config))
    return target


def _no_attention(folder: Path) -> Path:
    """A graph over the corpus's vocabulary that is no decoder: logits straight from the ids."""
    folder.mkdir()
    table = numpy_helper.from_array(np.zeros((384, 384), np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["logits"])], "lookup",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "rows"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "rows", 384])],
        [table])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              str(folder / "model.onnx"))
    return folder


def _garbage(folder: Path) -> Path:
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"not a protobuf at all")
    return folder


@pytest.mark.parametrize("make, message", [
    (lambda tmp, models: tmp / "nowhere", "the reference model (--reference) cannot be read"),
    (lambda tmp, models: _garbage(tmp / "garbage"),
     "the reference model (--reference) cannot be read"),
    (lambda tmp, models: models["tiny"], "has a vocabulary of 256 tokens and the model 384"),
    (lambda tmp, models: _no_attention(tmp / "lookup"), "is not a decoder the runtime loads"),
    (lambda tmp, models: build_static_decoder(tmp / "static", "tiny", chunk_size=4,
                                              capacity=24),
     "is a static (fixed-shape) decoder"),
    (lambda tmp, models: _with_context_length(models["llama"], tmp / "short", 16),
     "the validation prompts do not fit the reference"),
], ids=["missing", "unreadable", "vocabulary", "no-decoder", "static", "too-short"])
def test_a_reference_that_cannot_be_compared_is_refused(folder, reference_model, capsys,
                                                        tmp_path, make, message):
    models = {"tiny": reference_model("base"), "llama": folder("genai-llama-fp32")}
    code, out, err = _cli(capsys, folder("genai-llama-fp32", "int8"), "--reference",
                          make(tmp_path, models), *QUICK)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err


@pytest.mark.parametrize("args, message", [
    (["--reference-max-logits-diff", 0.1], "compares against a reference model, and none"),
    (["--reference-max-logits-diff", 0.1, "--reference-min-agreement", 0.9],
     "compare against a reference model, and none"),
    (["--reference", "REF", "--reference-min-agreement", 1.5], "from 0 to 1"),
    (["--reference", "REF", "--reference-max-logits-diff", "nan"], "finite number >= 0"),
    (["--reference", "REF", "--reference-max-logits-diff", -1], "finite number >= 0"),
])
def test_bad_thresholds_are_refused(folder, capsys, args, message):
    model = folder("genai-llama-fp32")
    args = [model if arg == "REF" else arg for arg in args]
    code, out, err = _cli(capsys, model, *args, *QUICK)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err


def test_the_python_api_takes_the_same_options(folder):
    model = folder("genai-llama-fp32")
    with pytest.raises(ConfigError, match="none is given"):
        ValidationOptions(reference_min_agreement=0.5)
    report = validate_model(model, ValidationOptions(
        provider="cpu", lengths=(5,), new_tokens=2, reference=model, reference_min_agreement=1.0,
        skip=resolve_skip(["numerics", "cache", "engine"])))
    checks = {check.name: check for check in report.checks}
    assert checks["reference.greedy_agreement"].outcome is Outcome.PASSED
    assert checks["reference.greedy_agreement"].details["positions"] == 2


def test_a_static_model_takes_no_reference(folder, tmp_path, capsys):
    static = build_static_decoder(tmp_path / "static", "tiny", chunk_size=4, capacity=24)
    code, out, err = _cli(capsys, static, "--reference", folder("genai-llama-fp32"),
                          "--provider", "cpu")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "compares dynamic decoders" in err


def test_the_junit_report_may_not_replace_a_file_of_the_reference(folder, capsys):
    original = folder("genai-llama-fp32")
    before = (original / "genai_config.json").read_bytes()
    code, out, err = _cli(capsys, folder("genai-llama-fp32", "int8"), "--reference", original,
                          "--junit", original / "genai_config.json", *QUICK)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "would replace" in err
    assert (original / "genai_config.json").read_bytes() == before
