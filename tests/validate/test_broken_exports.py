"""The gate on real exports: broken copies of builder exports fail validate on float32 and INT4
alike, while the unbroken exports pass with the tolerance their own kernels' noise sets."""

from __future__ import annotations

import pytest
from onnx import TensorProto

from onnx_chunk.validate import (
    Outcome,
    ValidationOptions,
    numerics,
    reference,
    resolve_skip,
    validate_model,
)
from tests.exports.corpus import ROOT

from .mutations import (
    FAKE_ROUNDING,
    edit_graph,
    past_one_short,
    rounds_by_row_count,
    seqlens_without_past,
)

EXPORTS = ("genai-llama-fp32", "genai-llama-int4", "genai-qwen3-int4")
# One prompt inside a chunk, one over three chunks (8, 7, 2 after the one-row borrow) and one
# over two with a remainder: the later chunks carry their past.
OPTIONS = ValidationOptions(provider="cpu", chunk_size=8, lengths=(5, 17, 13), new_tokens=3,
                            skip=resolve_skip(["cache", "engine"]))
MUTATIONS = {
    "past ignored": seqlens_without_past(layer=1),
    "positions and KV write one off": past_one_short(layer=0),
}
NUMERICS = ("numerics.greedy_tokens", "numerics.logits", "numerics.kv_prefix")


def _checks(report):
    return {check.name: check for check in report.checks}


@pytest.fixture(scope="module")
def good_reports():
    reports = {}

    def report(name):
        if name not in reports:
            reports[name] = validate_model(ROOT / name, OPTIONS)
        return reports[name]

    return report


@pytest.mark.parametrize("name", EXPORTS)
def test_a_good_export_passes_within_its_noise_floor(good_reports, name):
    report = good_reports(name)
    assert not report.failed, report.to_table()
    logits = _checks(report)["numerics.logits"].details
    assert logits["tolerance"] == max(logits["base_atol"], logits["margin"] * logits["floor"])
    assert max(logits["max_abs_difference"]["chunked"]) <= logits["tolerance"]
    if name.endswith("fp32"):  # float32 keeps the tight bound: one ulp stays a few ulps
        assert logits["floor"] < 1e-5 / logits["margin"] and logits["tolerance"] == 1e-5


@pytest.mark.parametrize("name", EXPORTS)
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_broken_export_fails_the_numerics(good_reports, tmp_path, name, mutation):
    folder = tmp_path / name
    import shutil

    shutil.copytree(ROOT / name, folder)
    edit_graph(folder / "model.onnx", MUTATIONS[mutation])
    report = validate_model(folder, OPTIONS)
    checks = _checks(report)
    assert report.failed
    for check in ("numerics.logits", "numerics.kv_prefix"):
        assert checks[check].outcome is Outcome.FAILED, checks[check].reason
        details = checks[check].details
        # Far outside the noise: the fault is not a rounding the margin could excuse.
        assert details["max_abs_difference_overall"] > 10 * details["tolerance"]
    # The prompt inside one chunk is untouched: only later chunks see the fault.
    assert checks["numerics.logits"].details["max_abs_difference"]["chunked"][0] <= (
        checks["numerics.logits"].details["tolerance"])
    good = _checks(good_reports(name))["numerics.logits"].details
    assert checks["numerics.logits"].details["floor"] == good["floor"]


@pytest.mark.parametrize("name", ["genai-llama-fp32", "genai-llama-int4"])
def test_padded_rows_leaking_into_the_cache_fail_the_padded_run(monkeypatch, name):
    """A runtime fault, not a graph one: after a padded forward the sequence's length also
    takes the padded rows, so they stay in the cache as if they were prompt rows."""
    from onnx_chunk.runtime.runner.model_runner import ModelRunner

    run = ModelRunner.run

    def leaky(self, slot, forward):
        ran = run(self, slot, forward)
        for row in forward.rows:
            row.length.advance(ran.padded_rows)
        return ran

    monkeypatch.setattr(ModelRunner, "run", leaky)
    report = validate_model(ROOT / name, OPTIONS)
    checks = _checks(report)
    assert "padded up the ladder" in checks["numerics.logits"].reason
    for check in ("numerics.logits", "numerics.kv_prefix"):
        assert checks[check].outcome is Outcome.FAILED, checks[check].reason
        assert f"padded {'logits' if check.endswith('logits') else 'KV prefix'} vs" in (
            checks[check].reason)
        chunked = checks[check].details["max_abs_difference"]["chunked"]
        assert max(chunked) <= checks[check].details["tolerance"]


FAKES = ("lone block", "threads")


@pytest.mark.parametrize("name", ["genai-llama-fp32", "genai-llama-int4"])
@pytest.mark.parametrize("kind", FAKES)
def test_a_kernel_that_rounds_by_row_count_passes_on_the_floor_it_makes(tmp_path, name, kind):
    """A fake kernel moves rows by the forward's row count only (the last row of 2 x 8 + 1
    rows alone in its block, or the second half of the rows as a second thread's): chunked and
    whole forwards then differ far beyond the base tolerance, and the floor, measured on the
    widths the runs use, carries it."""
    import shutil

    folder = tmp_path / name
    shutil.copytree(ROOT / name, folder)
    edit_graph(folder / "model.onnx", rounds_by_row_count(layer=0, kind=kind))
    report = validate_model(folder, OPTIONS)
    checks = _checks(report)
    assert not report.failed, report.to_table()
    for check in ("numerics.logits", "numerics.kv_prefix"):
        details = checks[check].details
        assert details["max_abs_difference_overall"] > details["base_atol"]
        assert details["floor"] > 0 and 17 in details["floor_rows"]


@pytest.mark.parametrize("kind", FAKES)
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_broken_export_fails_beside_a_kernel_that_rounds_by_row_count(tmp_path, kind,
                                                                        mutation):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(ROOT / "genai-llama-int4", folder)
    edit_graph(folder / "model.onnx", rounds_by_row_count(layer=0, kind=kind))
    edit_graph(folder / "model.onnx", MUTATIONS[mutation])
    checks = _checks(validate_model(folder, OPTIONS))
    for check in ("numerics.logits", "numerics.kv_prefix"):
        assert checks[check].outcome is Outcome.FAILED, checks[check].reason
        details = checks[check].details
        assert details["max_abs_difference_overall"] > 10 * details["tolerance"]


@pytest.mark.parametrize("name", EXPORTS)
def test_exact_mode_passes_bit_for_bit(name):
    report = validate_model(ROOT / name, ValidationOptions(
        provider="cpu", chunk_size=8, lengths=(5, 17, 13, 9), new_tokens=3, exact=True,
        skip=resolve_skip(["cache"])))
    checks = _checks(report)
    assert not report.failed, report.to_table()
    for check in ("numerics.logits", "numerics.kv_prefix"):
        details = checks[check].details
        assert details["tolerance"] == 0.0 and details["max_abs_difference_overall"] == 0.0


def test_exact_mode_fails_a_kernel_that_rounds_by_row_count(tmp_path):
    import shutil

    folder = tmp_path / "threads"
    shutil.copytree(ROOT / "genai-llama-fp32", folder)
    edit_graph(folder / "model.onnx", rounds_by_row_count(layer=0, kind="threads"))
    checks = _checks(validate_model(folder, ValidationOptions(
        provider="cpu", chunk_size=8, lengths=(5, 17, 13), new_tokens=3, exact=True,
        skip=resolve_skip(["cache", "engine"]))))
    assert checks["numerics.logits"].outcome is Outcome.FAILED
    assert "--atol 0" in checks["numerics.logits"].reason


@pytest.mark.parametrize("perturbed", [True, False])
def test_a_difference_no_pair_shows_is_covered_by_the_models_response_to_it(
        monkeypatch, tmp_path, perturbed):
    """Quantized activations turn a few ulps of attention into a flipped code now and then, so a
    pair of forwards shows the flip by luck (qwen05-int4 --int8-matmul: 0.128 at 513 rows,
    pairs 1.7e-6); the forward whose attention moved everywhere shows it. Stand-in: the
    lone-block kernel moves the row alone by FAKE_ROUNDING, no compared pair holds that row
    (widths 16 alone), and the model's one ulp is FAKE_ROUNDING: with the perturbed forward the
    floor covers the difference, without it the gate fails a good export."""
    import shutil

    folder = tmp_path / "lone"
    shutil.copytree(ROOT / "genai-llama-int4", folder)
    edit_graph(folder / "model.onnx", rounds_by_row_count(layer=0, kind="lone block"))
    monkeypatch.setattr(numerics, "floor_widths", lambda settings: (16,))
    monkeypatch.setitem(reference.ONE_ULP_UP, TensorProto.FLOAT, 1.0 + FAKE_ROUNDING)
    if not perturbed:
        monkeypatch.setattr(numerics, "attention_noise_graph", lambda model: (None, 0))
    checks = _checks(validate_model(folder, OPTIONS))
    for check in ("numerics.logits", "numerics.kv_prefix"):
        details = checks[check].details
        assert details["max_abs_difference_overall"] > details["base_atol"]
        assert details["floor_rows"] == [16]
        if perturbed:
            assert checks[check].outcome is Outcome.PASSED, checks[check].reason
            assert details["floor_perturbed_rows"] == 16 and details["floor"] > 0
        else:
            assert checks[check].outcome is Outcome.FAILED, checks[check].reason
            assert details["floor"] == 0 and details["floor_perturbed_rows"] is None


def test_a_broken_export_fails_however_much_the_model_magnifies_an_ulp(monkeypatch, tmp_path):
    """The perturbed forward runs from an empty cache: a model as sensitive as the stand-in
    above still fails by far when its chunks misread their past."""
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(ROOT / "genai-llama-int4", folder)
    edit_graph(folder / "model.onnx", MUTATIONS["positions and KV write one off"])
    monkeypatch.setitem(reference.ONE_ULP_UP, TensorProto.FLOAT, 1.0 + FAKE_ROUNDING)
    checks = _checks(validate_model(folder, OPTIONS))
    for check in ("numerics.logits", "numerics.kv_prefix"):
        assert checks[check].outcome is Outcome.FAILED, checks[check].reason
        details = checks[check].details
        assert details["floor_perturbed_rows"] == 17 and details["floor"] > 1e-5
        assert details["max_abs_difference_overall"] > 10 * details["tolerance"]
