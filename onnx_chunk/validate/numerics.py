"""Numerics: whole-prompt forward vs chunked vs chunked with ladder padding, judged against the
kernels' own noise.

Three runtimes of the model run one after another (each closed before the next is loaded):
1. The reference: chunk = capacity, no padding, on the last-row copy of the graph (`reference`)
   so a whole-prompt forward never makes [prompt, vocab] logits. Per prompt length it keeps its
   greedy generation (a request on the engine's step: the tokens and the rows they were chosen
   from, the last prompt row first), each chunk boundary's row (a whole forward of that prefix)
   and the KV prefix: a few rows of the vocabulary.
2. Chunked at W without padding, and 3. chunked at W with ladder padding: each prompt fed by
   the runtime's own chunk schedule (each chunk's last row kept), then decoded on the
   reference's tokens (the runtime's greedy choice at every row recorded, never fed), compared
   with the reference as soon as it finishes and let go.

The noise floor is measured on the chunked runtime before its runs: the same prefix rows
computed from an empty cache in forwards of different row counts (1, 2, q/2 + 1 and q rows,
q = min(W, longest prompt, 64)), which are mathematically equal, so any difference is the
kernels' own rounding (an INT4 MatMulNBits sums in another order for another row count). A check
passes when its difference is within `--atol` when given, else within max(base atol, margin x
floor). Greedy tokens must agree except at a near-tie: where the reference's top two logits are
within the logits tolerance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnx_chunk.errors import OnnxChunkError
from onnx_chunk.runtime import Runtime
from onnx_chunk.validate.checks import NUMERICS
from onnx_chunk.validate.prompts import seeded_prompt
from onnx_chunk.validate.reference import last_row_graph
from onnx_chunk.validate.report import CheckResult, Outcome
from onnx_chunk.validate.runs import (
    Advance,
    PromptRun,
    RunSettings,
    chunked_run,
    load_runtime,
    prefix_forward,
    reference_run,
)

logger = logging.getLogger(__name__)

WHOLE, CHUNKED, PADDED = "whole", "chunked", "padded"
MODES = (WHOLE, CHUNKED, PADDED)
LOGITS, KV = "logits", "kv"
# Rows compared at a time, so the float64 differences stay small on a large vocabulary.
_ROW_BLOCK = 64
# The widest forward of the noise floor (rows of [rows, vocab] logits on the host).
FLOOR_ROWS = 64


@dataclass(frozen=True)
class LengthComparison:
    """One prompt length through the three modes, reduced to what the checks report.

    `tokens` maps each mode to its greedy tokens; `logits` and `kv` map CHUNKED and PADDED to
    the max abs difference from the reference (inf when shapes differ or a value is NaN);
    `parted` maps CHUNKED and PADDED to the steps where their greedy choice differs:
    (step, their token, the reference's, the reference's top-1 minus top-2 logit there).
    """

    length: int
    tokens: dict[str, tuple[int, ...]]
    logits: dict[str, float]
    kv: dict[str, float]
    parted: dict[str, list[tuple[int, int, int, float]]] = field(default_factory=dict)


@dataclass(frozen=True)
class NoiseFloor:
    """The largest difference between mathematically equal rows of forwards of different row
    counts, for logits and KV; `rows`: the row counts compared; `note`: why a floor is 0."""

    logits: float
    kv: float
    rows: tuple[int, ...]
    note: str | None = None


def tolerance(settings: RunSettings, floor: float) -> float:
    """`--atol` when given, else max(base atol, margin x floor)."""
    if settings.atol_given:
        return settings.atol
    return max(settings.atol, settings.margin * floor)


def numerics_checks(model_path: Path, settings: RunSettings, selected: Callable[[str], bool],
                    advance: Advance) -> list[CheckResult]:
    """The selected numerics checks (greedy_tokens, logits, kv_prefix)."""
    started = time.perf_counter()
    names = [name for name in ("greedy_tokens", "logits", "kv_prefix") if selected(name)]
    if not names:
        return []
    try:
        comparisons, floor, notes = compare_modes(model_path, settings, advance)
    except OnnxChunkError as error:
        reason = f"the runtime cannot run the model: {error}"
        seconds = (time.perf_counter() - started) / len(names)
        return [CheckResult(f"{NUMERICS}.{name}", NUMERICS, Outcome.FAILED, reason, seconds)
                for name in names]
    share = (time.perf_counter() - started) / len(names)
    verdicts = {
        "greedy_tokens": lambda: _greedy_tokens(comparisons, settings, floor, notes),
        "logits": lambda: _compare(comparisons, settings, floor.logits, floor, notes, "logits",
                                   lambda comparison: comparison.logits),
        "kv_prefix": lambda: _compare(comparisons, settings, floor.kv, floor, notes,
                                      "KV prefix", lambda comparison: comparison.kv),
    }
    results = []
    for name in names:
        outcome, reason, details = verdicts[name]()
        results.append(CheckResult(f"{NUMERICS}.{name}", NUMERICS, outcome, reason, share,
                                   details))
    return results


def compare_modes(model_path: Path, settings: RunSettings, advance: Advance) -> tuple[
        list[LengthComparison], NoiseFloor, dict[str, str]]:
    """Run the three modes one runtime at a time; the per-length comparisons, the noise floor
    and notes on how each mode ran."""
    notes: dict[str, str] = {}
    references = _references(model_path, settings, advance, notes)
    comparisons = [LengthComparison(reference.length, {WHOLE: reference.tokens}, {}, {})
                   for reference in references]
    floor = NoiseFloor(0.0, 0.0, ())
    for mode in (CHUNKED, PADDED):
        with load_runtime(model_path, settings, chunk_size=settings.chunk_size,
                          padding=mode == PADDED) as runtime:
            if mode == CHUNKED:
                floor = noise_floor(runtime, settings)
                notes[CHUNKED] = f"chunked at W={runtime.stats.chunk_size}"
            for reference, comparison in zip(references, comparisons):
                run = chunked_run(runtime, reference, settings)
                advance(f"{mode} {reference.length}")
                comparison.tokens[mode] = run.tokens
                comparison.logits[mode] = _logits_difference(reference, run)
                comparison.kv[mode] = max_abs_difference(reference.kv, run.kv)
                comparison.parted[mode] = [
                    (step, own, wanted, reference.margins[step])
                    for step, (own, wanted) in enumerate(zip(run.tokens, reference.tokens))
                    if own != wanted]
                del run
            if mode == PADDED:
                notes[PADDED] = (
                    f"padded up the ladder {', '.join(map(str, runtime.stats.ladder))}"
                    if runtime.stats.padding != "off"
                    else f"padding refused ({runtime.stats.cache.padding_refused}), so the "
                         "padded run is chunked only")
    return comparisons, floor, notes


def _references(model_path: Path, settings: RunSettings, advance: Advance,
                notes: dict[str, str]) -> list[PromptRun]:
    """The reference runs of every length, on the last-row copy of the graph when one can be
    made (held in memory: the model's folder is never written)."""
    try:
        graph = last_row_graph(model_path)
    except OSError as error:
        logger.info("no last-row copy of %s (%s); the reference computes every row",
                    model_path, error)
        graph = None
    with load_runtime(model_path, settings, chunk_size=settings.capacity, padding=False,
                      graph=graph) as runtime:
        if runtime.debug.ports.last_row_logits and graph is None:
            notes[LOGITS] = "the decoder returns the last row's logits only"
        references = []
        for length in settings.lengths:
            references.append(reference_run(runtime, length, settings))
            advance(f"{WHOLE} {length}")
    return references


def noise_floor(runtime: Runtime, settings: RunSettings) -> NoiseFloor:
    """The kernels' noise on mathematically equal rows: the first p rows of a forward of q
    rows against a forward of those p rows alone (p = 1, 2, q/2 + 1), from an empty cache."""
    with runtime.open_sequence() as sequence:
        windows = [port.window for port in sequence.buffers.kv_ports if port.window]
    widest = min([max(settings.lengths), runtime.stats.chunk_size, FLOOR_ROWS, *windows])
    if widest < 2:
        return NoiseFloor(0.0, 0.0, (widest,), "no prompt of two rows to compare")
    ids = seeded_prompt(runtime.stats.vocab_size, max(settings.lengths), settings.seed)[:widest]
    logits, kv = prefix_forward(runtime, ids)
    worst = {LOGITS: 0.0, KV: 0.0}
    counts = sorted({1, 2, widest // 2 + 1} & set(range(1, widest)))
    for rows in counts:
        part_logits, part_kv = prefix_forward(runtime, ids[:rows])
        if logits is not None and part_logits is not None:
            worst[LOGITS] = max(worst[LOGITS],
                                max_abs_difference((logits[:rows],), (part_logits,)))
        worst[KV] = max(worst[KV], max_abs_difference(tuple(array[:rows] for array in kv),
                                                      tuple(part_kv)))
    note = ("the decoder returns the last row's logits only, so its logits floor is 0"
            if logits is None else None)
    return NoiseFloor(worst[LOGITS], worst[KV], (*counts, widest), note)


def _logits_difference(reference: PromptRun, run: PromptRun) -> float:
    if sorted(reference.rows) != sorted(run.rows) or len(reference.decode) != len(run.decode):
        return float("inf")
    rows = sorted(reference.rows)
    return max_abs_difference(
        (np.stack([reference.rows[row] for row in rows]), *reference.decode),
        (np.stack([run.rows[row] for row in rows]), *run.decode))


def _summary(settings: RunSettings, notes: dict[str, str]) -> str:
    lengths = ", ".join(map(str, settings.lengths))
    return f"lengths {lengths}; capacity {settings.capacity}; {notes[CHUNKED]}; {notes[PADDED]}"


def _judgement(settings: RunSettings, measured: float, floor: float) -> dict:
    return {"floor": floor, "margin": None if settings.atol_given else settings.margin,
            "base_atol": settings.atol, "atol_given": settings.atol_given,
            "tolerance": tolerance(settings, floor), "max_abs_difference_overall": measured}


def _bound(settings: RunSettings, floor: float) -> str:
    if settings.atol_given:
        return f"--atol {settings.atol:g}"
    return (f"tolerance {tolerance(settings, floor):.3g} = max(atol {settings.atol:g}, noise "
            f"floor {floor:.3g} x margin {settings.margin:g})")


def _greedy_tokens(comparisons: list[LengthComparison], settings: RunSettings,
                   floor: NoiseFloor, notes: dict[str, str]) -> tuple[Outcome, str, dict]:
    bound = tolerance(settings, floor.logits)
    near_ties: list[dict[str, Any]] = [
        {"mode": mode, "length": comparison.length, "step": step, "token": own,
         "reference_token": wanted, "reference_margin": gap}
        for mode in (CHUNKED, PADDED) for comparison in comparisons
        for step, own, wanted, gap in comparison.parted.get(mode, [])]
    details: dict = {"lengths": list(settings.lengths), "capacity": settings.capacity,
                     "tokens": {mode: [list(comparison.tokens[mode])
                                       for comparison in comparisons] for mode in MODES},
                     "parted": near_ties, **_judgement(settings, 0.0, floor.logits)}
    details.pop("max_abs_difference_overall")
    for entry in near_ties:
        if float(entry["reference_margin"]) > bound:
            return (Outcome.FAILED, f"{entry['mode']} greedy token at prompt length "
                    f"{entry['length']}, step {entry['step']} is {entry['token']}, the "
                    f"whole-prompt forward's {entry['reference_token']}, whose lead over the "
                    f"runner-up {entry['reference_margin']:.3g} exceeds the logits "
                    f"{_bound(settings, floor.logits)}", details)
    agreement = (f"identical over {settings.new_tokens} new tokens" if not near_ties else
                 f"identical over {settings.new_tokens} new tokens except {len(near_ties)} "
                 f"step(s) that part at a near-tie (the reference's top-2 margin within "
                 f"{bound:.3g})")
    return (Outcome.PASSED, f"{agreement}: {_summary(settings, notes)}", details)


def _compare(comparisons: list[LengthComparison], settings: RunSettings, floor_value: float,
             floor: NoiseFloor, notes: dict[str, str], what: str,
             differences: Callable[[LengthComparison], dict[str, float]]) -> tuple[
                 Outcome, str, dict]:
    per_length = {mode: [differences(comparison)[mode] for comparison in comparisons]
                  for mode in (CHUNKED, PADDED)}
    worst = {mode: max(values) for mode, values in per_length.items()}
    bound = tolerance(settings, floor_value)
    details = {"lengths": list(settings.lengths), "capacity": settings.capacity,
               "atol": bound, "max_abs_difference": per_length,
               "floor_rows": list(floor.rows),
               **_judgement(settings, max(worst.values()), floor_value)}
    if floor.note:
        details["floor_note"] = floor.note
    measured = ", ".join(f"{mode} {worst[mode]:.3g}" for mode in (CHUNKED, PADDED))
    scope = f" ({notes[LOGITS]})" if what == "logits" and LOGITS in notes else ""
    for mode in (CHUNKED, PADDED):
        if not worst[mode] <= bound:
            length = settings.lengths[int(np.argmax(per_length[mode]))]
            return (Outcome.FAILED, f"{mode} {what} vs the whole-prompt forward: max |diff| "
                    f"{worst[mode]:.3g} > {_bound(settings, floor_value)} (worst at prompt "
                    f"length {length}){scope}; {_summary(settings, notes)}", details)
    return (Outcome.PASSED, f"max |diff| against the whole-prompt forward {measured} <= "
            f"{_bound(settings, floor_value)}{scope}; {_summary(settings, notes)}", details)


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
