"""Numerics: whole-prompt forward vs chunked vs chunked with ladder padding.

Each seeded prompt runs through three runtimes of the same model: one whose chunk is the whole
capacity (one forward per prompt), one chunked at W without padding, one chunked at W with
padding up the ladder. The chunked and padded runs must reproduce the whole run: the same
greedy tokens, logits within the tolerance, the same KV prefix and recurrent state.

Memory stays at two runs of one prompt whatever the vocabulary: each length's chunked and
padded runs are compared with its whole run as they finish, and only the tokens and the
largest differences are kept.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnx_chunk.errors import OnnxChunkError
from onnx_chunk.runtime import Runtime
from onnx_chunk.validate.checks import NUMERICS
from onnx_chunk.validate.report import CheckResult, Outcome
from onnx_chunk.validate.runs import Advance, RunSettings, load_runtime, run_prompt

logger = logging.getLogger(__name__)

WHOLE, CHUNKED, PADDED = "whole", "chunked", "padded"
MODES = (WHOLE, CHUNKED, PADDED)
# Rows compared at a time, so the float64 differences stay small on a large vocabulary.
_ROW_BLOCK = 64


@dataclass(frozen=True)
class LengthComparison:
    """One prompt length through the three modes, reduced to what the checks report.

    `tokens` maps each mode to its greedy tokens; `logits` and `kv` map CHUNKED and PADDED to
    the max abs difference from the whole run (inf when shapes differ or a value is NaN).
    """

    length: int
    tokens: dict[str, tuple[int, ...]]
    logits: dict[str, float]
    kv: dict[str, float]


def numerics_checks(model_path: Path, settings: RunSettings, selected: Callable[[str], bool],
                    advance: Advance) -> list[CheckResult]:
    """The selected numerics checks (greedy_tokens, logits, kv_prefix)."""
    started = time.perf_counter()
    names = [name for name in ("greedy_tokens", "logits", "kv_prefix") if selected(name)]
    if not names:
        return []
    try:
        comparisons, notes = _compare_modes(model_path, settings, advance)
    except OnnxChunkError as error:
        reason = f"the runtime cannot run the model: {error}"
        seconds = (time.perf_counter() - started) / len(names)
        return [CheckResult(f"{NUMERICS}.{name}", NUMERICS, Outcome.FAILED, reason, seconds)
                for name in names]
    share = (time.perf_counter() - started) / len(names)
    verdicts = {
        "greedy_tokens": lambda: _greedy_tokens(comparisons, settings, notes),
        "logits": lambda: _compare(comparisons, settings, notes, "logits",
                                   lambda comparison: comparison.logits),
        "kv_prefix": lambda: _compare(comparisons, settings, notes, "KV prefix",
                                      lambda comparison: comparison.kv),
    }
    results = []
    for name in names:
        outcome, reason, details = verdicts[name]()
        results.append(CheckResult(f"{NUMERICS}.{name}", NUMERICS, outcome, reason, share,
                                   details))
    return results


def _compare_modes(model_path: Path, settings: RunSettings,
                   advance: Advance) -> tuple[list[LengthComparison], dict[str, str]]:
    runtimes: dict[str, Runtime] = {
        WHOLE: load_runtime(model_path, settings, chunk_size=settings.capacity, padding=False),
        CHUNKED: load_runtime(model_path, settings, chunk_size=settings.chunk_size,
                              padding=False),
        PADDED: load_runtime(model_path, settings, chunk_size=settings.chunk_size, padding=True),
    }
    comparisons = []
    for length in settings.lengths:
        whole = run_prompt(runtimes[WHOLE], length, settings)
        advance(f"{WHOLE} {length}")
        tokens, logits, kv = {WHOLE: whole.tokens}, {}, {}
        for mode in (CHUNKED, PADDED):
            other = run_prompt(runtimes[mode], length, settings)
            advance(f"{mode} {length}")
            tokens[mode] = other.tokens
            logits[mode] = max_abs_difference(whole.logits, other.logits)
            kv[mode] = max_abs_difference(whole.kv, other.kv)
            del other
        del whole
        comparisons.append(LengthComparison(length, tokens, logits, kv))
    padded = runtimes[PADDED]
    notes = {
        CHUNKED: f"chunked at W={runtimes[CHUNKED].options.chunk_size}",
        PADDED: (f"padded up the ladder {', '.join(map(str, padded.options.tiers))}"
                 if padded.padding
                 else f"padding refused ({padded.stats.cache.padding_refused}), so the "
                      "padded run is chunked only"),
    }
    if runtimes[WHOLE].ports.last_row_logits:
        notes["logits"] = "the decoder returns the last row's logits only"
    return comparisons, notes


def _summary(settings: RunSettings, notes: dict[str, str]) -> str:
    lengths = ", ".join(map(str, settings.lengths))
    return f"lengths {lengths}; capacity {settings.capacity}; {notes[CHUNKED]}; {notes[PADDED]}"


def _greedy_tokens(comparisons: list[LengthComparison], settings: RunSettings,
                   notes: dict[str, str]) -> tuple[Outcome, str, dict]:
    details: dict = {"lengths": list(settings.lengths), "capacity": settings.capacity,
                     "tokens": {mode: [list(comparison.tokens[mode])
                                       for comparison in comparisons] for mode in MODES}}
    for mode in (CHUNKED, PADDED):
        for comparison in comparisons:
            whole, other = comparison.tokens[WHOLE], comparison.tokens[mode]
            if whole != other:
                return (Outcome.FAILED, f"{mode} greedy tokens differ from the whole-prompt "
                        f"forward's at prompt length {comparison.length}: {list(other)} vs "
                        f"{list(whole)}", details)
    return (Outcome.PASSED, f"identical over {settings.new_tokens} new tokens: "
            f"{_summary(settings, notes)}", details)


def _compare(comparisons: list[LengthComparison], settings: RunSettings,
             notes: dict[str, str], what: str,
             differences: Callable[[LengthComparison], dict[str, float]]) -> tuple[
                 Outcome, str, dict]:
    per_length = {mode: [differences(comparison)[mode] for comparison in comparisons]
                  for mode in (CHUNKED, PADDED)}
    worst = {mode: max(values) for mode, values in per_length.items()}
    details = {"lengths": list(settings.lengths), "capacity": settings.capacity,
               "atol": settings.atol, "max_abs_difference": per_length}
    measured = ", ".join(f"{mode} {worst[mode]:.3g}" for mode in (CHUNKED, PADDED))
    scope = f" ({notes['logits']})" if what == "logits" and "logits" in notes else ""
    for mode in (CHUNKED, PADDED):
        if worst[mode] > settings.atol:
            length = settings.lengths[int(np.argmax(per_length[mode]))]
            return (Outcome.FAILED, f"{mode} {what} vs the whole-prompt forward: max |diff| "
                    f"{worst[mode]:.3g} > atol {settings.atol:g} (worst at prompt length "
                    f"{length}){scope}", details)
    return (Outcome.PASSED, f"max |diff| against the whole-prompt forward {measured} <= atol "
            f"{settings.atol:g}{scope}; {_summary(settings, notes)}", details)


def max_abs_difference(first: tuple[np.ndarray, ...], second: tuple[np.ndarray, ...]) -> float:
    """Largest |a - b| over paired arrays, in float64; inf for a shape mismatch or a NaN.

    Compared _ROW_BLOCK rows of the leading axis at a time, so the float64 temporaries stay a
    few rows of the vocabulary however long the prompt.
    """
    worst = 0.0
    for a, b in zip(first, second, strict=True):
        if a.shape != b.shape:
            return float("inf")
        if a.size == 0 or np.array_equal(a, b, equal_nan=True):
            continue
        rows_a, rows_b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        for begin in range(0, rows_a.shape[0], _ROW_BLOCK):
            block = np.abs(rows_a[begin:begin + _ROW_BLOCK].astype(np.float64)
                           - rows_b[begin:begin + _ROW_BLOCK].astype(np.float64))
            if np.isnan(block).any():
                return float("inf")
            worst = max(worst, float(block.max()))
    return worst
