"""The reference group (`--reference`): the model against another decoder of the same vocabulary.

What a quantized KV cache costs in accuracy is measured against the float cache of the same
weights: both models run the validation prompts (the same seeded prompts, chunk size, provider,
capacity) through the runtime, and the subject is teacher-forced on the reference's greedy
tokens, so every step compares the same positions.

Rules:
1. The reference is checked before anything runs: readable, a dynamic decoder the passes
   analyse with GroupQueryAttention, the subject's vocabulary size, room for the longest
   prompt and its new tokens. A reference that fails any of these, or that the runtime cannot
   load or run, is refused (ConfigError or ModelLoadError: one line, exit code 2).
2. Memory: the reference runs first and alone, before the other groups; it keeps per prompt
   its greedy generation (a request on the engine's step): the tokens and the row each was
   chosen from (the prefill's last row, then every decode step's): prompts x new tokens rows
   of the vocabulary. Its runtime is closed before any other is loaded, so its KV and the
   subject's are never held at once. The subject then runs last, comparing each row as it
   comes and keeping only the numbers.
3. `max_logits_diff`: the largest |subject - reference| over those rows (inf for a NaN).
   `greedy_agreement`: the share of positions where the subject's greedy choice (the
   runtime's sampler's: the argmax) is the reference's token. Up to its first disagreement a
   teacher-forced run is fed exactly what a free-running one feeds itself, so the first
   disagreement is where free-running generation first parts from the reference's (None when
   it never does within the new tokens).
4. Without a threshold a check reports and passes; with one it fails past it (difference above
   `max_logits_diff`, agreement below `min_agreement`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnx_chunk.errors import ConfigError, ModelLoadError, ModelStructureError, OnnxChunkError
from onnx_chunk.graph.model_folder import locate_model
from onnx_chunk.passes import analyze
from onnx_chunk.runtime import Runtime, Sequence
from onnx_chunk.validate.checks import REFERENCE
from onnx_chunk.validate.numerics import max_abs_difference
from onnx_chunk.validate.prompts import seeded_prompt
from onnx_chunk.validate.report import CheckResult, Outcome
from onnx_chunk.validate.runs import (
    Advance,
    RunSettings,
    greedy_choice,
    greedy_generation,
    load_runtime,
)
from onnx_chunk.validate.subject import Subject, load_subject

_LOGITS = "logits"


@dataclass(frozen=True)
class Thresholds:
    """Where the reference checks fail (None: they report and pass)."""

    max_logits_diff: float | None = None
    min_agreement: float | None = None


@dataclass(frozen=True)
class ReferenceModel:
    """A reference that passed rule 1's static checks: its decoder file and position limit."""

    path: Path
    limit: int | None


@dataclass(frozen=True)
class ReferenceSteps:
    """One prompt through the reference: its greedy tokens and each step's logits [vocab]."""

    length: int
    tokens: tuple[int, ...]
    logits: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class PromptComparison:
    """One prompt through the subject, teacher-forced on the reference's tokens."""

    length: int
    max_abs_difference: float
    reference_tokens: tuple[int, ...]
    subject_tokens: tuple[int, ...]

    @property
    def agreed(self) -> int:
        return sum(own == wanted for own, wanted in zip(self.subject_tokens,
                                                        self.reference_tokens))

    @property
    def first_divergence(self) -> int | None:
        """The first position where free-running generation parts from the reference (rule 3)."""
        return next((step for step, (own, wanted) in enumerate(
            zip(self.subject_tokens, self.reference_tokens)) if own != wanted), None)


def open_reference(path: str | os.PathLike, subject: Subject) -> ReferenceModel:
    """Rule 1's checks that need no run; ModelLoadError or ConfigError naming the reference."""
    try:
        reference = load_subject(path)
    except ModelLoadError as error:
        raise ModelLoadError(f"the reference model (--reference) cannot be read: "
                             f"{error}") from error
    where = f"the reference {str(reference.path)!r}"
    if reference.external_data_error is not None:
        raise ModelLoadError(f"{where} has broken weights: {reference.external_data_error}")
    if reference.static is not None:
        raise ConfigError(f"{where} is a static (fixed-shape) decoder; the reference must be a "
                          "dynamic decoder the runtime loads (converted or not)")
    try:
        plan = analyze(reference.model)
    except (ModelStructureError, ConfigError) as error:
        raise ConfigError(f"{where} is not a decoder the runtime loads: {error}") from error
    if plan.gqa_nodes == 0 and not plan.capacity_inputs:
        raise ConfigError(f"{where} is not a decoder the runtime loads: it has no "
                          "GroupQueryAttention node to bind a KV cache to")
    ours, theirs = vocabulary(subject), vocabulary(reference)
    if ours is not None and theirs is not None and ours != theirs:
        raise ConfigError(f"{where} has a vocabulary of {theirs} tokens and the model "
                          f"{ours}; compare models of the same vocabulary")
    genai = locate_model(reference.path).genai
    limits = [limit for limit in (plan.max_sequence_length,
                                  genai.context_length if genai is not None else None)
              if limit is not None]
    return ReferenceModel(reference.path, min(limits) if limits else None)


def vocabulary(subject: Subject) -> int | None:
    """The last axis of the `logits` output when the graph fixes it."""
    output = next((value for value in subject.model.graph.outputs if value.name == _LOGITS),
                  None)
    if output is None or output.shape is None or not output.shape.dims:
        return None
    size = output.shape.dims[-1]
    return size if isinstance(size, int) else None


def fitted_settings(reference: ReferenceModel, settings: RunSettings) -> RunSettings:
    """The run settings both models share: the subject's, the capacity at most the reference's
    limit; ConfigError when the longest prompt and its new tokens do not fit there."""
    if reference.limit is None or settings.capacity <= reference.limit:
        return settings
    longest = max(settings.lengths)
    if longest + settings.new_tokens > reference.limit:
        raise ConfigError(
            f"the validation prompts do not fit the reference {str(reference.path)!r}: the "
            f"longest ({longest} tokens) and {settings.new_tokens} new tokens need "
            f"{longest + settings.new_tokens} positions and it holds {reference.limit}; use "
            f"--lengths up to {reference.limit - settings.new_tokens}")
    return dataclasses.replace(settings, capacity=reference.limit,
                               chunk_size=min(settings.chunk_size, reference.limit))


def reference_steps(reference: ReferenceModel, settings: RunSettings,
                    advance: Advance) -> list[ReferenceSteps]:
    """Rule 2: every prompt greedily through the reference's runtime, closed before returning;
    ConfigError when the runtime cannot load or run it."""
    where = f"the reference {str(reference.path)!r}"
    try:
        runtime = load_runtime(reference.path, settings, chunk_size=settings.chunk_size,
                               padding=None)
    except OnnxChunkError as error:
        raise ConfigError(f"the runtime cannot load {where}: {error}") from error
    steps = []
    with runtime:
        for length in settings.lengths:
            try:
                steps.append(_greedy(runtime, length, settings))
            except (OnnxChunkError, RuntimeError) as error:
                raise ConfigError(f"the runtime cannot run {where} on a prompt of {length} "
                                  f"tokens: {error}") from error
            advance(f"reference {length}")
    return steps


def _greedy(runtime: Runtime, length: int, settings: RunSettings) -> ReferenceSteps:
    ids = seeded_prompt(runtime.stats.vocab_size, length, settings.seed)
    with runtime.open_sequence() as sequence:
        generation = greedy_generation(sequence, ids, settings.new_tokens)
    return ReferenceSteps(length, generation.tokens, generation.rows)


def compare_subject(model_path: Path, references: list[ReferenceSteps], settings: RunSettings,
                    advance: Advance) -> list[PromptComparison]:
    """The subject teacher-forced on each reference's tokens, one row compared at a time."""
    comparisons = []
    with load_runtime(model_path, settings, chunk_size=settings.chunk_size,
                      padding=None) as runtime:
        for reference in references:
            ids = seeded_prompt(runtime.stats.vocab_size, reference.length, settings.seed)
            with runtime.open_sequence() as sequence:
                comparisons.append(_forced(sequence, ids, reference,
                                           greedy_choice(runtime.stats.vocab_size)))
            advance(f"against the reference {reference.length}")
    return comparisons


def _forced(sequence: Sequence, ids: np.ndarray, reference: ReferenceSteps,
            choose: Callable[[np.ndarray], int]) -> PromptComparison:
    """The subject fed the prompt, then the reference's tokens; each row compared as it comes,
    and the token `choose` (the runtime's greedy choice) makes of it recorded, never fed."""
    worst, tokens = 0.0, []
    fed = (None, *reference.tokens[:-1])
    for token, wanted in zip(fed, reference.logits):
        logits = sequence.prefill(ids) if token is None else sequence.decode(token)
        worst = max(worst, max_abs_difference((logits,), (wanted,)))
        tokens.append(choose(logits))
    return PromptComparison(reference.length, worst, reference.tokens, tuple(tokens))


def reference_checks(model_path: Path, reference: ReferenceModel,
                     steps: list[ReferenceSteps], settings: RunSettings,
                     thresholds: Thresholds, selected: Callable[[str], bool],
                     advance: Advance) -> list[CheckResult]:
    """The selected reference checks (max_logits_diff, greedy_agreement)."""
    names = [name for name in ("max_logits_diff", "greedy_agreement") if selected(name)]
    if not names:
        return []
    started = time.perf_counter()
    try:
        comparisons = compare_subject(model_path, steps, settings, advance)
    except (OnnxChunkError, RuntimeError) as error:
        seconds = (time.perf_counter() - started) / len(names)
        return [CheckResult(f"{REFERENCE}.{name}", REFERENCE, Outcome.FAILED,
                            f"the runtime cannot run the model: {error}", seconds)
                for name in names]
    seconds = (time.perf_counter() - started) / len(names)
    scope = (f"against {str(reference.path)!r}, teacher-forced on its tokens: lengths "
             f"{', '.join(map(str, settings.lengths))} x {settings.new_tokens} positions; "
             f"capacity {settings.capacity}, W={settings.chunk_size}")
    verdicts = {"max_logits_diff": lambda: logits_verdict(comparisons, thresholds, scope),
                "greedy_agreement": lambda: agreement_verdict(comparisons, thresholds, scope)}
    results = []
    for name in names:
        outcome, reason, details = verdicts[name]()
        details = {"reference": str(reference.path), "lengths": list(settings.lengths),
                   "capacity": settings.capacity, "chunk_size": settings.chunk_size, **details}
        results.append(CheckResult(f"{REFERENCE}.{name}", REFERENCE, outcome, reason, seconds,
                                   details))
    return results


def logits_verdict(comparisons: list[PromptComparison], thresholds: Thresholds,
                   scope: str) -> tuple[Outcome, str, dict]:
    """Rule 4 on the largest logits difference."""
    worst = max(comparison.max_abs_difference for comparison in comparisons)
    limit = thresholds.max_logits_diff
    details = {"max_abs_difference": worst, "threshold": limit,
               "max_abs_difference_per_length": [comparison.max_abs_difference
                                                 for comparison in comparisons]}
    measured = f"max |logits diff| {worst:.4g}"
    if limit is None:
        return Outcome.PASSED, f"{measured} (no threshold); {scope}", details
    if not worst <= limit:
        return Outcome.FAILED, f"{measured} > {limit:g}; {scope}", details
    return Outcome.PASSED, f"{measured} <= {limit:g}; {scope}", details


def agreement_verdict(comparisons: list[PromptComparison], thresholds: Thresholds,
                      scope: str) -> tuple[Outcome, str, dict]:
    """Rule 4 on the share of positions whose greedy token agrees."""
    agreed = sum(comparison.agreed for comparison in comparisons)
    positions = sum(len(comparison.reference_tokens) for comparison in comparisons)
    share = agreed / positions
    limit = thresholds.min_agreement
    details = {
        "agreement": share, "agreed": agreed, "positions": positions, "threshold": limit,
        "agreement_per_length": [comparison.agreed / len(comparison.reference_tokens)
                                 for comparison in comparisons],
        "first_divergence": [comparison.first_divergence for comparison in comparisons],
        "tokens": {"reference": [list(comparison.reference_tokens)
                                 for comparison in comparisons],
                   "subject": [list(comparison.subject_tokens) for comparison in comparisons]},
    }
    parted = [f"length {comparison.length} at step {comparison.first_divergence}"
              for comparison in comparisons if comparison.first_divergence is not None]
    outcome, verdict = Outcome.PASSED, "(no threshold)"
    if limit is not None:
        outcome = Outcome.FAILED if share < limit else Outcome.PASSED
        verdict = f"{'<' if share < limit else '>='} {limit:g}"
    return (outcome, f"greedy agreement {share:.4g} ({agreed}/{positions}) {verdict}; first "
            f"free-running divergence: {', '.join(parted) if parted else 'none'}; {scope}",
            details)
