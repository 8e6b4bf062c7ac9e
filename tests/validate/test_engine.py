"""engine.batched_decode: the prompts through the batch engine, batched and alone at one slot
count, compared; what differs across slot counts is reported with its margin, not failed."""

from __future__ import annotations

import pytest

from onnx_chunk.validate import Outcome, ValidationOptions, resolve_skip, validate_model
from onnx_chunk.validate.engine import ENGINE_SLOTS, EngineRuns, batched_decode_verdict
from onnx_chunk.validate.runs import RunSettings

from .conftest import CHUNK

LENGTHS = (3, CHUNK + 1, 2 * CHUNK + 3, 30, 41)  # more prompts than slots: one waits
OPTIONS = ValidationOptions(chunk_size=CHUNK, provider="cpu", lengths=LENGTHS, new_tokens=3,
                            skip=resolve_skip(["numerics", "cache"]))
SETTINGS = RunSettings(provider="cpu", capacity=64, chunk_size=CHUNK, lengths=(3, 9),
                       new_tokens=3, seed=0, atol=1e-5)


def _engine(report):
    return next(check for check in report.checks if check.name == "engine.batched_decode")


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_the_prompts_share_decode_steps_and_keep_their_lone_tokens(reference_model, variant):
    check = _engine(validate_model(reference_model(variant), OPTIONS))
    assert check.outcome is Outcome.PASSED, check.reason
    details = check.details
    assert details["slots"] == ENGINE_SLOTS and details["lengths"] == list(LENGTHS)
    tokens = details["tokens"]
    assert tokens["batched"] == tokens["alone"]
    # 3 new tokens plus one per admitting step (16 prefill chunks at W=8), within the capacity
    assert [len(run) for run in tokens["batched"]] == [19, 19, 19, 19, 11]
    assert len(tokens["one_slot"]) == len(LENGTHS)
    # Counted by the engine: the batched pass really decoded several rows per forward.
    assert details["batched_rows_per_decode_step"] > 1
    assert f"batched on {ENGINE_SLOTS} slots" in check.reason
    # The served runtime's transfer counters, in the report's JSON: on CPU's host path the
    # forwards read and write host memory, so nothing is copied.
    assert details["transfers"] == {"host_to_device_bytes": 0, "device_to_host_bytes": 0,
                                    "synchronizations": 0}


def test_skip_engine_skips_it(reference_model):
    options = ValidationOptions(chunk_size=CHUNK, provider="cpu", lengths=(3,), new_tokens=2,
                                skip=resolve_skip(["engine"]))
    check = _engine(validate_model(reference_model("base"), options))
    assert (check.outcome, check.reason) == (Outcome.SKIPPED, "skipped (--skip)")


def _runs(alone, batched, single, margins=None):
    return EngineRuns(4, alone, batched, single, margins or [[5.0, 5.0, 5.0]] * len(single), 2.0)


def test_batched_tokens_that_differ_from_the_lone_ones_fail():
    outcome, reason, _ = batched_decode_verdict(
        _runs([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 7, 6]], [[1, 2, 3], [4, 5, 6]]), SETTINGS)
    assert outcome is Outcome.FAILED
    assert "prompt of length 9" in reason and "[4, 7, 6]" in reason and "[4, 5, 6]" in reason


def test_a_difference_across_slot_counts_is_reported_with_its_margin():
    outcome, reason, details = batched_decode_verdict(
        _runs([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 8, 9]],
              [[5.0, 5.0, 5.0], [3.0, 0.0125, 1.0]]), SETTINGS)
    assert outcome is Outcome.PASSED
    assert "1 of 2 part from one sequence's" in reason and "0.0125 (length 9, step 1)" in reason
    assert details["one_slot_differences"] == [
        {"length": 9, "step": 1, "single_slot_margin": 0.0125}]
    outcome, reason, details = batched_decode_verdict(
        _runs([[1, 2, 3]], [[1, 2, 3]], [[1, 2, 3]]), RunSettings(**{
            **SETTINGS.__dict__, "lengths": (3,)}))
    assert outcome is Outcome.PASSED and "equal one sequence's" in reason
    assert details["one_slot_differences"] == []
