"""The numerics comparison keeps numbers, not runs: differences by row block, runs let go."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from onnx_chunk.validate import numerics, runs
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


class _Runtime:
    """What the numerics read of a runtime, and a count of the runtimes open at once."""

    open_now = 0
    most_open = 0

    def __init__(self, chunk_size, padding):
        self.stats = SimpleNamespace(chunk_size=chunk_size, ladder=(4, 8),
                                     padding="repeat" if padding else "off",
                                     cache=SimpleNamespace(padding_refused=None))
        self.debug = SimpleNamespace(ports=SimpleNamespace(last_row_logits=False))

    def __enter__(self):
        _Runtime.open_now += 1
        _Runtime.most_open = max(_Runtime.most_open, _Runtime.open_now)
        return self

    def __exit__(self, *exc_info):
        _Runtime.open_now -= 1


VOCAB = 50


def _run(length, tokens=(1, 2), shift=0.0, margins=(5.0, 5.0)):
    rows = {row: np.zeros(VOCAB, np.float32) for row in runs.boundaries(length, CHUNK)}
    rows[length - 1] = rows[length - 1] + np.float32(shift)
    return PromptRun(length, tuple(tokens), tuple(margins), rows,
                     (np.zeros(VOCAB, np.float32),), (np.zeros((1, 2, length, 4), np.float32),))


def _fake(monkeypatch, *, floor=0.0, shifts=None, tokens=None, margins=(5.0, 5.0)):
    """Numerics over fake runtimes: the chunked run of length 9 is `shifts[9]` off in its last
    row and chooses `tokens[9]`; the reference's top-2 margins are `margins`."""
    shifts, tokens = shifts or {}, tokens or {}
    _Runtime.open_now = _Runtime.most_open = 0
    monkeypatch.setattr(numerics, "last_row_graph", lambda model, from_end=0: None)
    monkeypatch.setattr(numerics, "load_runtime",
                        lambda model, settings, *, chunk_size, padding, graph=None:
                        _Runtime(chunk_size, padding))
    monkeypatch.setattr(numerics, "reference_run",
                        lambda runtime, length, settings: _run(length, margins=margins))
    monkeypatch.setattr(numerics, "floor_widths", lambda settings: ())
    monkeypatch.setattr(numerics, "noise_floor",
                        lambda model, settings, shorter: numerics.NoiseFloor(floor, floor, (2, 8)))

    def chunked(runtime, reference, settings):
        chunked_mode = runtime.stats.padding == "off"
        return _run(reference.length,
                    tokens=tokens.get(reference.length, (1, 2)) if chunked_mode else (1, 2),
                    shift=shifts.get(reference.length, 0.0) if chunked_mode else 0.0)

    monkeypatch.setattr(numerics, "chunked_run", chunked)


def _checks(settings):
    labels: list[str] = []
    results = numerics.numerics_checks("model.onnx", settings, lambda name: True, labels.append)
    return {result.name: result for result in results}, labels


SETTINGS = RunSettings(provider="cpu", capacity=64, chunk_size=CHUNK, lengths=(3, 9, 17),
                       new_tokens=2, seed=0, atol=1e-5, margin=4.0)


def test_one_runtime_at_a_time_and_each_length_compared_by_its_rows(monkeypatch):
    _fake(monkeypatch, shifts={9: 0.5})
    checks, labels = _checks(SETTINGS)
    assert _Runtime.most_open == 1
    assert labels == ([f"whole {length}" for length in (3, 9, 17)]
                      + [f"{mode} {length}" for mode in ("chunked", "padded")
                         for length in (3, 9, 17)])
    logits = checks[f"{NUMERICS}.logits"]
    assert logits.outcome.value == "failed"
    assert logits.details["max_abs_difference"] == {"chunked": [0.0, 0.5, 0.0],
                                                     "padded": [0.0, 0.0, 0.0]}
    assert "worst at prompt length 9" in logits.reason
    assert checks[f"{NUMERICS}.kv_prefix"].details["max_abs_difference"]["chunked"] == [0.0] * 3
    assert checks[f"{NUMERICS}.greedy_tokens"].details["tokens"]["padded"] == [[1, 2]] * 3


def test_the_tolerance_is_the_noise_floor_times_the_margin(monkeypatch):
    _fake(monkeypatch, floor=0.1, shifts={9: 0.35})
    logits = _checks(SETTINGS)[0][f"{NUMERICS}.logits"]
    assert logits.outcome.value == "passed", logits.reason
    assert logits.details["floor"] == 0.1 and logits.details["margin"] == 4.0
    assert logits.details["tolerance"] == pytest.approx(0.4)
    assert "noise floor 0.1 x margin 4" in logits.reason
    _fake(monkeypatch, floor=0.1, shifts={9: 0.45})
    logits = _checks(SETTINGS)[0][f"{NUMERICS}.logits"]
    assert logits.outcome.value == "failed"
    assert "0.45 > tolerance 0.4" in logits.reason


def test_a_zero_floor_keeps_the_base_atol_and_atol_overrides_the_floor(monkeypatch):
    _fake(monkeypatch, floor=0.0, shifts={9: 2e-5})
    logits = _checks(SETTINGS)[0][f"{NUMERICS}.logits"]
    assert logits.outcome.value == "failed" and logits.details["tolerance"] == 1e-5
    _fake(monkeypatch, floor=0.1, shifts={9: 0.3})
    given = RunSettings(**{**SETTINGS.__dict__, "atol": 0.2, "atol_given": True})
    logits = _checks(given)[0][f"{NUMERICS}.logits"]
    assert logits.outcome.value == "failed" and "> --atol 0.2" in logits.reason
    assert logits.details["margin"] is None and logits.details["tolerance"] == 0.2


def test_greedy_tokens_may_part_only_at_a_near_tie(monkeypatch):
    # The chunked run of length 9 picks another token at step 1, where the reference leads by
    # 0.3: within a tolerance of 4 x 0.1 it is a near-tie, outside 4 x 0.05 it is a failure.
    _fake(monkeypatch, floor=0.1, tokens={9: (1, 7)}, margins=(5.0, 0.3))
    greedy = _checks(SETTINGS)[0][f"{NUMERICS}.greedy_tokens"]
    assert greedy.outcome.value == "passed", greedy.reason
    assert "except 1 step(s) that part at a near-tie" in greedy.reason
    assert greedy.details["parted"] == [{"mode": "chunked", "length": 9, "step": 1, "token": 7,
                                         "reference_token": 2, "reference_margin": 0.3}]
    _fake(monkeypatch, floor=0.05, tokens={9: (1, 7)}, margins=(5.0, 0.3))
    greedy = _checks(SETTINGS)[0][f"{NUMERICS}.greedy_tokens"]
    assert greedy.outcome.value == "failed"
    assert "step 1 is 7, the whole-prompt forward's 2" in greedy.reason
