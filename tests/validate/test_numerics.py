"""The numerics comparison keeps numbers, not runs: differences by row block, runs let go."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import numpy as np
import pytest

from onnx_chunk.validate import numerics
from onnx_chunk.validate.checks import NUMERICS
from onnx_chunk.validate.numerics import max_abs_difference
from onnx_chunk.validate.runs import PromptRun, RunSettings

from .conftest import CHUNK


def test_max_abs_difference_finds_the_largest_gap_in_any_row_block():
    rng = np.random.default_rng(0)
    prompt = rng.standard_normal((3 * 64 + 5, 40)).astype(np.float32)
    decode = rng.standard_normal((1, 40)).astype(np.float32)
    moved = prompt.copy()
    moved[3 * 64 + 2, 7] += np.float32(0.25)  # in the last, partial block
    moved[10, 3] += np.float32(0.125)
    assert max_abs_difference((prompt, decode), (moved, decode)) == pytest.approx(0.25, abs=1e-6)
    assert max_abs_difference((prompt, decode), (prompt.copy(), decode.copy())) == 0.0
    kv = rng.standard_normal((1, 2, 9, 4))
    shifted = kv.copy()
    shifted[0, 1, 8, 3] -= 1e-3
    assert max_abs_difference((kv,), (shifted,)) == pytest.approx(1e-3)


def test_max_abs_difference_is_infinite_for_nan_or_a_shape_mismatch():
    a = np.zeros((4, 3), np.float32)
    b = a.copy()
    b[2, 1] = np.nan
    assert max_abs_difference((a,), (b,)) == float("inf")
    assert max_abs_difference((a,), (a[:3],)) == float("inf")
    assert max_abs_difference((a[:0],), (a[:0],)) == 0.0


def test_each_length_is_compared_as_its_runs_finish_and_no_run_is_kept(monkeypatch):
    """A fake runtime per mode: chunked differs at the second length, padded nowhere."""
    vocab, settings = 50, RunSettings(provider="cpu", capacity=64, chunk_size=CHUNK,
                                      lengths=(3, 9, 17), new_tokens=2, seed=0, atol=1e-5)
    live: list[weakref.ref] = []
    most_alive_at_a_call = 0

    class _Runtime:
        def __init__(self, chunk_size, padding):
            self.options = SimpleNamespace(chunk_size=chunk_size, tiers=(4, 8))
            self.padding = padding
            self.ports = type("Ports", (), {"last_row_logits": False})()

    def fake_load(model_path, run_settings, *, chunk_size, padding):
        return _Runtime(chunk_size, padding)

    def fake_run(runtime, length, run_settings):
        nonlocal most_alive_at_a_call
        most_alive_at_a_call = max(most_alive_at_a_call, sum(ref() is not None for ref in live))
        logits = np.zeros((length, vocab), np.float32)
        if runtime.options.chunk_size == CHUNK and not runtime.padding and length == 9:
            logits[5, 11] = 0.5
        run = PromptRun(length, (1, 2), (logits, np.zeros((1, vocab), np.float32)),
                        (np.zeros((1, 2, length, 4), np.float32),))
        live.append(weakref.ref(run))
        return run

    monkeypatch.setattr(numerics, "load_runtime", fake_load)
    monkeypatch.setattr(numerics, "run_prompt", fake_run)
    labels: list[str] = []
    results = numerics.numerics_checks("model.onnx", settings, lambda name: True, labels.append)
    assert most_alive_at_a_call == 1  # the whole run while chunked and padded are made
    assert all(ref() is None for ref in live)
    assert labels == [f"{mode} {length}" for length in (3, 9, 17)
                      for mode in ("whole", "chunked", "padded")]
    checks = {result.name: result for result in results}
    logits = checks[f"{NUMERICS}.logits"]
    assert logits.details["max_abs_difference"] == {"chunked": [0.0, 0.5, 0.0],
                                                     "padded": [0.0, 0.0, 0.0]}
    assert "worst at prompt length 9" in logits.reason
    assert checks[f"{NUMERICS}.kv_prefix"].details["max_abs_difference"]["chunked"] == [0.0] * 3
    assert checks[f"{NUMERICS}.greedy_tokens"].details["tokens"]["padded"] == [[1, 2]] * 3
