"""Good reference decoders pass; each broken one fails the check that names its fault."""

from __future__ import annotations

import functools

import pytest

from onnx_chunk.validate import Outcome, ValidationOptions, resolve_skip, runs, validate_model

from .conftest import CHUNK
from .mutations import (
    copy_model,
    edit_graph,
    past_from_zero_constant,
    seqlens_without_past,
    set_metadata,
)

OPTIONS = ValidationOptions(chunk_size=CHUNK, provider="cpu")
LENGTHS = (1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + CHUNK // 3 + 1)
# Enough for tests that need no boundary lengths: one prompt in one chunk, one over two full
# chunks (8, 7, 2 after the one-row borrow), so chunked runs carry their past.
SHORT = dict(lengths=(3, 2 * CHUNK + 1), new_tokens=2)


@pytest.fixture(scope="module")
def report_of():
    """`report_of(model, options)`: validate an unmodified model once per module, then reuse."""
    reports = {}

    def validate(model, options):
        key = (str(model), options)
        if key not in reports:
            reports[key] = validate_model(model, options)
        return reports[key]

    return validate


def _by_name(report):
    return {check.name: check for check in report.checks}


def _outcomes(report):
    return {check.name: check.outcome for check in report.checks}


@pytest.mark.parametrize("variant", ["base", "int4", "position_ids", "inputs_embeds",
                                     "last_token_logits", "conv_hybrid"])
def test_unconverted_good_variants_pass_with_the_plan_checks_skipped(reference_model, report_of,
                                                                      variant):
    report = report_of(reference_model(variant), OPTIONS)
    checks = _by_name(report)
    assert not report.failed
    skipped = {name for name, check in checks.items() if check.outcome is Outcome.SKIPPED}
    assert skipped == {"structure.metadata", "structure.ladder"}
    assert "not converted; run onnx-chunk convert" in checks["structure.metadata"].reason
    tokens = checks["numerics.greedy_tokens"].details["tokens"]
    assert checks["numerics.greedy_tokens"].details["lengths"] == list(LENGTHS)
    assert all(len(run) == 4 for mode in tokens.values() for run in mode)
    assert tokens["chunked"] == tokens["whole"] == tokens["padded"]
    for name in ("numerics.logits", "numerics.kv_prefix"):
        details = checks[name].details
        differences = details["max_abs_difference"]
        if variant == "int4":  # MatMulNBits rounds by row count: within its measured noise
            assert max(differences["chunked"] + differences["padded"]) <= details["tolerance"]
            assert details["tolerance"] == max(1e-5, details["margin"] * details["floor"])
        else:  # float32: one ulp of attention stays a few ulps, so the tight bound holds
            assert details["floor"] < 1e-5 / details["margin"] and details["tolerance"] == 1e-5
            assert differences["chunked"] == differences["padded"] == [0.0] * len(LENGTHS)
    cache = checks["cache.second_pass"].details
    assert cache["after_second_pass"]["compiles"] == cache["first_pass"]["compiles"] > 0
    assert checks["cache.variant_cap"].details["peak_variants"] <= 4


def test_a_converted_model_passes_every_check(converted_model, report_of):
    report = report_of(converted_model("base"), ValidationOptions(provider="cpu"))
    assert report.summary() == {"passed": 15, "failed": 0, "skipped": 0}
    checks = _by_name(report)
    assert "tiers 3, 6, 8 plus the decode shape" in checks["structure.ladder"].reason
    assert "4 KV inputs annotated" in checks["structure.kv_capacity"].reason
    assert "padded up the ladder 3, 6, 8" in checks["numerics.logits"].reason


def test_conv_hybrid_refuses_padding_and_still_passes(converted_model, report_of):
    report = report_of(converted_model("conv_hybrid"), ValidationOptions(provider="cpu", **SHORT))
    checks = _by_name(report)
    assert not report.failed
    assert checks["structure.padding"].outcome is Outcome.PASSED
    assert checks["structure.padding"].reason.startswith("not eligible")
    assert "past.0.conv" in checks["structure.padding"].reason
    assert "past.0.conv -> present.0.conv" in checks["structure.recurrent_state"].reason
    assert "padding refused" in checks["numerics.greedy_tokens"].reason
    assert "padding off" in checks["cache.second_pass"].reason


def test_last_token_logits_compares_the_last_row(reference_model, report_of):
    checks = _by_name(report_of(reference_model("last_token_logits"), OPTIONS))
    assert "last row's logits only" in checks["numerics.logits"].reason


def test_an_input_the_runtime_cannot_feed_fails_the_runs(reference_model, report_of):
    checks = _by_name(report_of(reference_model("odd_port"), OPTIONS))
    assert checks["structure.padding"].reason.startswith("not eligible")
    assert "row_scale" in checks["structure.padding"].reason
    for name in ("numerics.greedy_tokens", "numerics.logits", "numerics.kv_prefix",
                 "cache.second_pass", "cache.variant_cap"):
        assert checks[name].outcome is Outcome.FAILED
        assert "cannot run the model" in checks[name].reason and "row_scale" in checks[name].reason


def test_a_ladder_that_does_not_fit_the_cap_thrashes(converted_model, monkeypatch):
    # conv_hybrid refuses padding: full chunks (8), remainders (dynamic) and decode (1) are
    # three shapes under a cap of 2. The served runtime gets per-width variants, as a provider
    # whose default they are (CUDA) serves it; the CPU provider's one session cannot thrash.
    served = runs.load
    monkeypatch.setattr(runs, "load", functools.partial(served, specialize=True))
    report = validate_model(converted_model("conv_hybrid", max_variants=2),
                            ValidationOptions(provider="cpu", skip=resolve_skip(["numerics"]),
                                              **SHORT))
    checks = _by_name(report)
    assert _outcomes(report)["cache.second_pass"] is Outcome.FAILED
    assert "do not fit under the cap of 2" in checks["cache.second_pass"].reason
    counters = checks["cache.second_pass"].details
    assert counters["after_second_pass"]["compiles"] > counters["first_pass"]["compiles"]
    assert checks["cache.variant_cap"].outcome is Outcome.PASSED
    assert checks["structure.ladder"].outcome is Outcome.PASSED


def test_a_gqa_whose_past_is_not_a_graph_input_fails_kv_capacity(reference_model, tmp_path):
    model = copy_model(reference_model("base"), tmp_path / "model")
    edit_graph(model, past_from_zero_constant(layer=0, capacity=64))
    report = validate_model(model, ValidationOptions(chunk_size=CHUNK, provider="cpu", **SHORT))
    checks = _by_name(report)
    assert checks["structure.kv_capacity"].outcome is Outcome.FAILED
    assert "layers.0" in checks["structure.kv_capacity"].reason
    assert checks["structure.gqa"].outcome is Outcome.PASSED
    assert checks["structure.padding"].reason.startswith("not eligible")
    assert checks["numerics.logits"].outcome is Outcome.FAILED  # later chunks miss their past


def test_a_layer_that_ignores_its_past_fails_the_numerics(reference_model, tmp_path):
    model = copy_model(reference_model("base"), tmp_path / "model")
    edit_graph(model, seqlens_without_past(layer=1))
    report = validate_model(model, OPTIONS)
    outcomes = _outcomes(report)
    structure = {name: outcome for name, outcome in outcomes.items()
                 if name.startswith("structure.")}
    assert Outcome.FAILED not in structure.values()
    assert outcomes["numerics.logits"] is Outcome.FAILED
    assert outcomes["numerics.kv_prefix"] is Outcome.FAILED
    reason = _by_name(report)["numerics.logits"].reason
    assert "chunked logits vs the whole-prompt forward" in reason
    assert "> tolerance 1e-05 = max(atol 1e-05, noise floor " in reason
    # Prompts that fit in one chunk are unaffected; only multi-chunk prompts differ.
    differences = _by_name(report)["numerics.logits"].details["max_abs_difference"]["chunked"]
    assert differences[0] == 0.0 and max(differences[3:]) > 1e-3


def test_a_missing_external_data_file_fails_external_data(reference_model, tmp_path):
    model = copy_model(reference_model("base"), tmp_path / "model")
    (model.parent / "model.onnx.data").unlink()
    report = validate_model(model, OPTIONS)
    checks = _by_name(report)
    assert checks["structure.external_data"].outcome is Outcome.FAILED
    assert "model.onnx.data" in checks["structure.external_data"].reason
    assert "missing" in checks["structure.external_data"].reason
    assert checks["structure.gqa"].outcome is Outcome.PASSED
    for name in ("numerics.logits", "cache.second_pass"):
        assert checks[name].outcome is Outcome.SKIPPED
        assert "weights cannot be loaded" in checks[name].reason


def test_metadata_that_contradicts_the_graph_fails_metadata(converted_model, tmp_path):
    model = copy_model(converted_model("base"), tmp_path / "model")
    edit_graph(model, set_metadata(
        "onnx_chunk.kv_capacity",
        '{"gqa_nodes":2,"kv_bindings":[],"max_sequence_length":99,"problems":[]}'))
    report = validate_model(model, ValidationOptions(provider="cpu", skip=frozenset(
        {"numerics.greedy_tokens", "numerics.logits", "numerics.kv_prefix",
         "cache.second_pass", "cache.variant_cap"})))
    check = _by_name(report)["structure.metadata"]
    assert check.outcome is Outcome.FAILED
    assert "max_sequence_length: stored 99, the graph gives 2048" in check.reason
    assert set(check.details["differences"]) == {"capacity_inputs", "kv_bindings",
                                                 "max_sequence_length"}


def test_an_oversized_stored_ladder_fails_the_ladder(converted_model, tmp_path):
    model = copy_model(converted_model("base"), tmp_path / "model")
    edit_graph(model, set_metadata("runtime_configurable.chunked_prefill.ladder", "2,4,6,8"))
    checks = _by_name(validate_model(model, ValidationOptions(provider="cpu", skip=frozenset(
        {"cache.second_pass", "numerics.greedy_tokens", "numerics.logits",
         "numerics.kv_prefix"}))))
    assert checks["structure.ladder"].outcome is Outcome.FAILED
    assert "4 tiers plus the decode shape need 5 variants but the cap is 4" in (
        checks["structure.ladder"].reason)
    assert checks["cache.second_pass"].reason == "skipped (--skip)"


def test_the_default_settings_pass_a_good_model(reference_model, report_of):
    """Default chunk 512: the W + 1 prompt's last row lands 1-2 ulp off the whole-prompt
    forward on CPU, inside the default tolerance; tokens stay identical."""
    report = report_of(reference_model("base"), ValidationOptions(provider="cpu"))
    assert not report.failed, report.to_table()
