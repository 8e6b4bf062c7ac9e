"""Numerics: whole-prompt forward vs chunked vs chunked with ladder padding.

Each seeded prompt runs through three runtimes of the same model: one whose chunk is the whole
capacity (one forward per prompt), one chunked at W without padding, one chunked at W with
padding up the ladder. The chunked and padded runs must reproduce the whole run: the same
greedy tokens, logits within the tolerance, the same KV prefix and recurrent state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from onnx_chunk.errors import OnnxChunkError
from onnx_chunk.runtime import Runtime
from onnx_chunk.validate.checks import NUMERICS
from onnx_chunk.validate.report import CheckResult, Outcome
from onnx_chunk.validate.runs import Advance, PromptRun, RunSettings, load_runtime, run_prompt

logger = logging.getLogger(__name__)

WHOLE, CHUNKED, PADDED = "whole", "chunked", "padded"
MODES = (WHOLE, CHUNKED, PADDED)


def numerics_checks(model_path: Path, settings: RunSettings, selected: Callable[[str], bool],
                    advance: Advance) -> list[CheckResult]:
    """The selected numerics checks (greedy_tokens, logits, kv_prefix)."""
    started = time.perf_counter()
    names = [name for name in ("greedy_tokens", "logits", "kv_prefix") if selected(name)]
    if not names:
        return []
    try:
        runs, notes = _run_modes(model_path, settings, advance)
    except OnnxChunkError as error:
        reason = f"the runtime cannot run the model: {error}"
        seconds = (time.perf_counter() - started) / len(names)
        return [CheckResult(f"{NUMERICS}.{name}", NUMERICS, Outcome.FAILED, reason, seconds)
                for name in names]
    share = (time.perf_counter() - started) / len(names)
    verdicts = {
        "greedy_tokens": lambda: _greedy_tokens(runs, settings, notes),
        "logits": lambda: _compare(runs, settings, notes, "logits", lambda run: (run.logits,)),
        "kv_prefix": lambda: _compare(runs, settings, notes, "KV prefix",
                                      lambda run: run.kv),
    }
    results = []
    for name in names:
        outcome, reason, details = verdicts[name]()
        results.append(CheckResult(f"{NUMERICS}.{name}", NUMERICS, outcome, reason, share,
                                   details))
    return results


def _run_modes(model_path: Path, settings: RunSettings,
               advance: Advance) -> tuple[dict[str, list[PromptRun]], dict[str, str]]:
    runtimes: dict[str, Runtime] = {
        WHOLE: load_runtime(model_path, settings, chunk_size=settings.capacity, padding=False),
        CHUNKED: load_runtime(model_path, settings, chunk_size=settings.chunk_size,
                              padding=False),
        PADDED: load_runtime(model_path, settings, chunk_size=settings.chunk_size, padding=True),
    }
    runs = {mode: [] for mode in MODES}
    for length in settings.lengths:
        for mode, runtime in runtimes.items():
            runs[mode].append(run_prompt(runtime, length, settings))
            advance(f"{mode} {length}")
    padded = runtimes[PADDED]
    notes = {
        CHUNKED: f"chunked at W={runtimes[CHUNKED].chunk_size}",
        PADDED: (f"padded up the ladder {', '.join(map(str, padded.tiers))}" if padded.padding
                 else f"padding refused ({padded.stats().cache.padding_refused}), so the "
                      "padded run is chunked only"),
    }
    if runtimes[WHOLE].ports.last_row_logits:
        notes["logits"] = "the decoder returns the last row's logits only"
    return runs, notes


def _summary(settings: RunSettings, notes: dict[str, str]) -> str:
    lengths = ", ".join(map(str, settings.lengths))
    return f"lengths {lengths}; {notes[CHUNKED]}; {notes[PADDED]}"


def _greedy_tokens(runs: dict[str, list[PromptRun]], settings: RunSettings,
                   notes: dict[str, str]) -> tuple[Outcome, str, dict]:
    details: dict = {"lengths": list(settings.lengths),
                     "tokens": {mode: [list(run.tokens) for run in runs[mode]] for mode in MODES}}
    for mode in (CHUNKED, PADDED):
        for whole, other in zip(runs[WHOLE], runs[mode]):
            if whole.tokens != other.tokens:
                return (Outcome.FAILED, f"{mode} greedy tokens differ from the whole-prompt "
                        f"forward's at prompt length {whole.length}: {list(other.tokens)} vs "
                        f"{list(whole.tokens)}", details)
    return (Outcome.PASSED, f"identical over {settings.new_tokens} new tokens: "
            f"{_summary(settings, notes)}", details)


def _compare(runs: dict[str, list[PromptRun]], settings: RunSettings, notes: dict[str, str],
             what: str, arrays: Callable[[PromptRun], tuple[np.ndarray, ...]]) -> tuple[
                 Outcome, str, dict]:
    worst: dict[str, float] = {}
    per_length: dict[str, list[float]] = {}
    for mode in (CHUNKED, PADDED):
        differences = [_max_abs_difference(arrays(whole), arrays(other))
                       for whole, other in zip(runs[WHOLE], runs[mode])]
        per_length[mode] = differences
        worst[mode] = max(differences)
    details = {"lengths": list(settings.lengths), "atol": settings.atol,
               "max_abs_difference": per_length}
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


def _max_abs_difference(first: tuple[np.ndarray, ...], second: tuple[np.ndarray, ...]) -> float:
    worst = 0.0
    for a, b in zip(first, second, strict=True):
        if a.shape != b.shape:
            return float("inf")
        if a.size == 0 or np.array_equal(a, b, equal_nan=True):
            continue
        difference = np.abs(a.astype(np.float64) - b.astype(np.float64))
        worst = max(worst, float("inf") if np.isnan(difference).any() else float(difference.max()))
    return worst
