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

The noise floor follows the kernels the compared runs use: for every forward width n those
runs make (each prompt's whole forward and its boundary prefixes, each chunk, each padded
width; n >= 2), the rows of a forward of n rows from an empty cache against the same rows in a
forward of n + 1 rows (the last row's logits, read through `last_row_graph` with `from_end` 1,
and every row's KV). Those rows are mathematically equal, so any difference is the kernels'
rounding by row count: ONNX Runtime's CPU GroupQueryAttention computes a forward's rows in
blocks from its first row, and the last row of a forward of k blocks + 1 rows, alone in its
block, takes MLAS's one-row GEMM (docs/row_grouping.md); another CPU or kernel may split rows
by threads or tiles. Quantized activations turn such a difference of a few ulps into a flipped
code now and then, which runs through every later layer, so one pair shows it by luck; the
floor also takes the longest width's forward on a copy of the graph whose attention outputs
all moved one ulp up (`reference.attention_noise_graph`) against the plain one: what the model
makes of the kernels' noise. No past is involved in either, so a bug in how a chunk continues
a past (positions, KV offsets, padded rows) cannot hide in the floor. A check passes when its
difference is within `--atol` when given, else within max(base atol, margin x floor). Greedy
tokens must agree except at a near-tie: where the reference's top two logits are within the
logits tolerance. In exact mode (`--exact`) every runtime runs exactly and the tolerance is 0:
no floor is measured.
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
from onnx_chunk.ladder import padded_width
from onnx_chunk.runtime import Runtime
from onnx_chunk.runtime.engine.scheduler import prefill_chunks
from onnx_chunk.validate.checks import NUMERICS
from onnx_chunk.validate.prompts import seeded_prompt
from onnx_chunk.validate.reference import attention_noise_graph, last_row_graph
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
    counts, or of a forward whose attention outputs moved one ulp, for logits and KV; `rows`:
    the widths n compared (each against n + 1 rows); `perturbed_rows`: the width of the
    forward run with its `perturbed_nodes` attention outputs one ulp up (None: not run);
    `note`: why a floor is 0 or not perturbed."""

    logits: float
    kv: float
    rows: tuple[int, ...]
    note: str | None = None
    perturbed_rows: int | None = None
    perturbed_nodes: int = 0


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
    widths = () if settings.exact else floor_widths(settings)
    references, shorter = _references(model_path, settings, advance, notes, widths)
    comparisons = [LengthComparison(reference.length, {WHOLE: reference.tokens}, {}, {})
                   for reference in references]
    floor = (NoiseFloor(0.0, 0.0, (), "exact mode compares bit for bit")
             if settings.exact else noise_floor(model_path, settings, shorter))
    del shorter
    for mode in (CHUNKED, PADDED):
        with load_runtime(model_path, settings, chunk_size=settings.chunk_size,
                          padding=mode == PADDED) as runtime:
            if mode == CHUNKED:
                notes[CHUNKED] = (f"chunked at W={runtime.stats.chunk_size}"
                                  + (" in exact mode" if settings.exact else ""))
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
                notes: dict[str, str], widths: tuple[int, ...]) -> tuple[
                    list[PromptRun], dict[int, FloorRows]]:
    """The reference runs of every length, on the last-row copy of the graph when one can be
    made (held in memory: the model's folder is never written), and the noise floor's shorter
    forwards: n rows of each width in `widths`, from an empty cache. In exact mode the
    reference runs the model's own graph (exact mode refuses last-row decoders: an odd forward
    gets a padded row), which computes every row's logits unless it was converted with logits
    rows."""
    graph = None
    if not settings.exact:
        try:
            graph = last_row_graph(model_path)
        except OSError as error:
            logger.info("no last-row copy of %s (%s); the reference computes every row",
                        model_path, error)
    with load_runtime(model_path, settings, chunk_size=settings.capacity, padding=False,
                      graph=graph) as runtime:
        if runtime.debug.ports.last_row_logits and graph is None:
            notes[LOGITS] = "the decoder returns the last row's logits only"
        references = []
        for length in settings.lengths:
            references.append(reference_run(runtime, length, settings))
            advance(f"{WHOLE} {length}")
        shorter = {width: floor_rows(runtime, floor_ids(runtime, width, settings)[:width])
                   for width in widths}
    return references, shorter


def floor_widths(settings: RunSettings) -> tuple[int, ...]:
    """Every forward width of at least two rows the compared runs make, below the capacity:
    each prompt's whole forward and boundary prefixes (reference), its chunks (chunked) and
    their ladder widths (padded, `settings.tiers`)."""
    widths = set()
    for length in settings.lengths:
        chunks = prefill_chunks(length, settings.chunk_size)
        widths.add(length)
        widths.update(end for _, end in chunks[:-1])
        for begin, end in chunks:
            widths.add(end - begin)
            if settings.tiers:
                widths.add(padded_width(end - begin, settings.tiers, settings.capacity - begin))
    return tuple(sorted(width for width in widths if 2 <= width < settings.capacity))


def floor_ids(runtime: Runtime, width: int, settings: RunSettings) -> np.ndarray:
    """The noise floor's ids for width n: n + 1 seeded ids (the first n for the shorter
    forward)."""
    return seeded_prompt(runtime.stats.vocab_size, width + 1, settings.seed)


@dataclass(frozen=True)
class FloorRows:
    """One side of a noise floor pair: its row's logits (None when the decoder cannot give
    that row alone) and the KV it wrote, each buffer's positions on the leading axis."""

    logits: np.ndarray | None
    kv: list[np.ndarray]


def floor_rows(runtime: Runtime, ids: np.ndarray) -> FloorRows:
    """One forward of `ids` from an empty cache on a runtime whose decoder returns one row's
    logits (the last, or the one `last_row_graph`'s `from_end` names): that row and the KV."""
    logits, kv = prefix_forward(runtime, ids, every=False)
    return FloorRows(logits, kv)


def noise_floor(model_path: Path, settings: RunSettings,
                shorter: dict[int, FloorRows]) -> NoiseFloor:
    """The kernels' noise where the compared runs put rows (module docstring): for each width
    n of `shorter` (its forwards of n rows), a forward of n + 1 rows on a copy of the graph
    whose LM head reads the row before the last, compared on row n - 1's logits and the KV of
    the first n rows."""
    if not shorter:
        return NoiseFloor(0.0, 0.0, (), "no forward of two rows to compare")
    try:
        graph = last_row_graph(model_path, from_end=1)
    except OSError as error:
        logger.info("no copy of %s reading the row before the last (%s)", model_path, error)
        graph = None
    worst = {LOGITS: 0.0, KV: 0.0}
    note = None
    with load_runtime(model_path, settings, chunk_size=settings.capacity, padding=False,
                      graph=graph) as runtime:
        one_row = runtime.debug.ports.last_row_logits
        for width, first in shorter.items():
            ids = floor_ids(runtime, width, settings)
            # Without the copy the decoder gives every row's logits (its head was not found)
            # or its last row's only (then no logits floor).
            logits, kv = prefix_forward(runtime, ids, every=not one_row)
            row = logits if graph is not None else None if one_row else logits[-2]
            if first.logits is None or row is None:
                note = "the decoder returns the last row's logits only, so its logits floor is 0"
            else:
                worst[LOGITS] = max(worst[LOGITS], max_abs_difference(
                    (first.logits[None],), (row[None],)))
            worst[KV] = max(worst[KV], max_abs_difference(
                tuple(first.kv), tuple(array[:width] for array in kv)))
    perturbed = max(shorter)
    graph, count = attention_noise_graph(model_path)
    if graph is None:
        note = note or "no attention node to perturb: the floor is the row-count pairs alone"
        return NoiseFloor(worst[LOGITS], worst[KV], tuple(shorter), note)
    with load_runtime(model_path, settings, chunk_size=settings.capacity, padding=False,
                      graph=graph) as runtime:
        ids = floor_ids(runtime, perturbed, settings)[:perturbed]
        logits, kv = prefix_forward(runtime, ids, every=False)
    first = shorter[perturbed]
    if first.logits is not None and logits.size == first.logits.size:
        worst[LOGITS] = max(worst[LOGITS], max_abs_difference(
            (first.logits.reshape(1, -1),), (logits.reshape(1, -1),)))
    worst[KV] = max(worst[KV], max_abs_difference(tuple(first.kv), tuple(kv)))
    return NoiseFloor(worst[LOGITS], worst[KV], tuple(shorter), note, perturbed, count)


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
               "floor_rows": list(floor.rows), "floor_perturbed_rows": floor.perturbed_rows,
               "floor_perturbed_nodes": floor.perturbed_nodes,
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
