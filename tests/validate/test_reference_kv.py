"""The whole `onnx-chunk validate --reference` on int8 and int4 caches: every default check group.

The subjects are `convert --kv-dtype int8|int4` folders (default calibration) of the corpus's
fp32 llama export; the reference is that export as it is. Nothing is skipped: the structure,
numerics, cache, engine and reference groups all run on the quantized cache and pass, and the
reference numbers reported are the ones two runtimes of the folders give here.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from onnx_chunk.cli import main
from onnx_chunk.runtime import load
from onnx_chunk.validate.prompts import seeded_prompt
from tests.exports.corpus import ROOT

EXPORT = ROOT / "genai-llama-fp32"
GROUPS = ["cache", "engine", "numerics", "reference", "structure"]


def _steps(folder, capacity: int, chunk_size: int, length: int, new: int,
           fed: list[int] | None = None) -> tuple[list[int], list[np.ndarray]]:
    """Each step's argmax and logits on the seeded prompt of `length`: free-running, or
    teacher-forced on `fed`."""
    with load(folder, provider="cpu", capacity=capacity, chunk_size=chunk_size) as runtime:
        ids = seeded_prompt(runtime.stats.vocab_size, length, 0)
        with runtime.open_sequence() as sequence:
            rows = [sequence.prefill(ids).copy()]
            for step in range(new - 1):
                token = int(np.argmax(rows[-1])) if fed is None else fed[step]
                rows.append(sequence.decode(token))
    return [int(np.argmax(row)) for row in rows], rows


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_validate_reference_runs_every_check_group_on_a_quantized_cache(kv_dtype, tmp_path,
                                                                        capsys):
    subject = tmp_path / f"kv-{kv_dtype}"
    assert main(["convert", str(EXPORT), "-o", str(subject), "--kv-dtype", kv_dtype]) == 0
    capsys.readouterr()
    code = main(["validate", str(subject), "--provider", "cpu", "--reference", str(EXPORT),
                 "--json"])
    report = json.loads(capsys.readouterr().out)
    checks = {check["name"]: check for check in report["checks"]}
    assert code == 0, [check["reason"] for check in checks.values()
                       if check["outcome"] != "passed"]
    assert sorted({check["group"] for check in checks.values()}) == GROUPS
    assert all(check["outcome"] == "passed" for check in checks.values())

    logits = checks["reference.max_logits_diff"]
    tokens = checks["reference.greedy_agreement"]
    details = tokens["details"]
    lengths, capacity, width = details["lengths"], details["capacity"], details["chunk_size"]
    new = details["positions"] // len(lengths)
    assert logits["details"]["lengths"] == lengths and new >= 1
    worst = logits["details"]["max_abs_difference"]
    # Rounding the cache moves the logits: zero would mean one model ran twice.
    assert math.isfinite(worst) and worst > 0.0
    assert f"max |logits diff| {worst:.4g} (no threshold)" in logits["reason"]
    assert details["agreement"] == details["agreed"] / details["positions"]
    assert (f"greedy agreement {details['agreement']:.4g} ({details['agreed']}/"
            f"{details['positions']}) (no threshold)") in tokens["reason"]

    # The numbers again, from a runtime of each folder: the subject teacher-forced on the
    # reference's greedy tokens, and where its own free-running tokens part from them.
    expected_worst, agreed = 0.0, 0
    for index, length in enumerate(lengths):
        wanted, reference_rows = _steps(EXPORT, capacity, width, length, new)
        assert details["tokens"]["reference"][index] == wanted
        forced, rows = _steps(subject, capacity, width, length, new, fed=wanted)
        assert details["tokens"]["subject"][index] == forced
        expected_worst = max(expected_worst, *(float(np.abs(row.astype(np.float64) - ref).max())
                                               for row, ref in zip(rows, reference_rows)))
        agreed += sum(own == token for own, token in zip(forced, wanted))
        free, _ = _steps(subject, capacity, width, length, new)
        parted = next((step for step, (own, token) in enumerate(zip(free, wanted))
                       if own != token), None)
        assert details["first_divergence"][index] == parted
    assert worst == pytest.approx(expected_worst, rel=1e-6)
    assert details["agreed"] == agreed
