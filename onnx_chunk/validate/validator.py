"""Validate a decoder for chunked prefill: run the selected checks, return a Report.

Order: structure (graph, weights, plan), then for a dynamic decoder numerics and cache
behaviour on the runtime, or for a static decoder its own checks. A check that cannot run
because an earlier one found the model unusable is skipped with the reason. With a reference
model, its runs come before the runtime groups and the subject's comparison after them
(agreement), so no two runtimes are loaded at once.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from onnx_chunk import arguments
from onnx_chunk.errors import ConfigError, OnnxChunkError
from onnx_chunk.graph.chunk_plan import ChunkPlan, window_capacity
from onnx_chunk.passes import DEFAULT_CHUNK_SIZE
from onnx_chunk.runtime import Runtime
from onnx_chunk.runtime.device.provider import PROVIDER_CHOICES, resolve_device
from onnx_chunk.runtime.options import resolve_tiers
from onnx_chunk.static.loading import check_fixed_sizes
from onnx_chunk.validate.agreement import (
    ReferenceModel,
    ReferenceSteps,
    Thresholds,
    fitted_settings,
    open_reference,
    reference_checks,
    reference_steps,
)
from onnx_chunk.validate.cache import cache_checks
from onnx_chunk.validate.checks import (
    CACHE,
    CHECKS,
    ENGINE,
    NUMERICS,
    REFERENCE,
    STATIC,
    STATIC_STRUCTURE,
    STRUCTURE,
    full_name,
)
from onnx_chunk.validate.engine import ENGINE_SLOTS, engine_checks, engine_runs_planned
from onnx_chunk.validate.numerics import MODES, numerics_checks
from onnx_chunk.validate.prompts import boundary_lengths
from onnx_chunk.validate.report import CheckResult, Outcome, Report
from onnx_chunk.validate.runs import RunSettings, load_runtime
from onnx_chunk.validate.static import StaticSettings, planned_runs, static_checks
from onnx_chunk.validate.structure import check_checker, check_external_data, structure_checks
from onnx_chunk.validate.subject import Subject, load_subject
from onnx_chunk.validate.timing import Stopwatch

logger = logging.getLogger(__name__)

DEFAULT_NEW_TOKENS = 4
# Default tolerances on logits and KV, the floor of the measured tolerance below. On the CPU
# provider a chunked prefill reproduces the whole-prompt forward bit for bit unless one of the
# two forwards leaves a query row alone in a block of ONNX Runtime's CPU attention (a forward of
# k x 2 x head size + 1 rows: docs/row_grouping.md); float32 exports then differ by 1-2 ulp,
# INT4 exports, whose matmuls quantize the differing activations, by far more (qwen05-int4:
# 0.0635 on logits), which the measured noise floor covers. Other providers pick kernels per
# shape. A static decoder's chunked run is compared with one-row forwards, whose sums run in
# another order (~2e-6).
CPU_ATOL = 1e-5
# Without --atol, a numerics check's tolerance is max(base atol, NOISE_MARGIN x the noise
# floor): the largest difference the kernels themselves make between mathematically equal rows
# of forwards of different row counts, or that one ulp more in every attention output makes
# (numerics.noise_floor).
NOISE_MARGIN = 4.0
DEVICE_ATOL = 1e-3
STATIC_ATOL = 1e-4


@dataclass(frozen=True)
class ValidationOptions:
    """What to check and how; validated on construction (ConfigError)."""

    skip: frozenset[str] = frozenset()
    lengths: tuple[int, ...] | None = None
    new_tokens: int = DEFAULT_NEW_TOKENS
    provider: str = "auto"
    seed: int = 0
    chunk_size: int | None = None
    atol: float | None = None
    max_input_len: int | None = None
    decode_model: Path | None = None
    reference: str | os.PathLike | None = None
    reference_max_logits_diff: float | None = None
    reference_min_agreement: float | None = None
    exact: bool = False
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.provider not in PROVIDER_CHOICES:
            raise ConfigError(f"unknown provider {self.provider!r}; expected one of "
                              f"{', '.join(PROVIDER_CHOICES)}")
        arguments.integer(self.new_tokens, "new tokens", minimum=1, error=ConfigError)
        arguments.integer(self.seed, "the seed", minimum=0, error=ConfigError)
        if self.lengths is not None:
            if not self.lengths:
                raise ConfigError("prompt lengths must be at least 1, got none")
            for length in self.lengths:
                arguments.integer(length, "prompt lengths", minimum=1, error=ConfigError)
        arguments.optional_integer(self.chunk_size, "the chunk size", minimum=1,
                                   error=ConfigError)
        arguments.optional_integer(self.max_input_len, "max_input_len", minimum=1,
                                   error=ConfigError)
        arguments.optional_integer(self.threads, "threads", minimum=1, error=ConfigError)
        if self.atol is not None and (isinstance(self.atol, bool)
                                      or not isinstance(self.atol, (int, float))
                                      or not (self.atol >= 0 and math.isfinite(self.atol))):
            raise ConfigError(f"atol must be a finite number >= 0, got {self.atol!r}")
        if not isinstance(self.exact, bool):
            raise ConfigError(f"exact must be True or False, got {self.exact!r}")
        if self.exact and self.atol:
            raise ConfigError(f"exact (--exact) compares bit for bit, a tolerance of 0; drop "
                              f"atol (--atol {self.atol:g})")
        thresholds = [name for name, value in (
            ("reference_max_logits_diff (--reference-max-logits-diff)",
             self.reference_max_logits_diff),
            ("reference_min_agreement (--reference-min-agreement)",
             self.reference_min_agreement)) if value is not None]
        if thresholds and self.reference is None:
            raise ConfigError(f"{' and '.join(thresholds)} "
                              f"{'compare' if len(thresholds) > 1 else 'compares'} against a "
                              "reference model, and none is given; add one (reference, "
                              "--reference)")
        if self.reference_max_logits_diff is not None and not _number_within(
                self.reference_max_logits_diff, 0.0, math.inf):
            raise ConfigError("reference_max_logits_diff must be a finite number >= 0, got "
                              f"{self.reference_max_logits_diff!r}")
        if self.reference_min_agreement is not None and not _number_within(
                self.reference_min_agreement, 0.0, 1.0):
            raise ConfigError("reference_min_agreement must be a number from 0 to 1, got "
                              f"{self.reference_min_agreement!r}")

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(self.reference_max_logits_diff, self.reference_min_agreement)


def _number_within(value: object, lowest: float, highest: float) -> bool:
    """Whether `value` is a finite int or float (not a bool) in [lowest, highest]."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and lowest <= value <= highest)


class Progress(Protocol):
    """Receives the number of prompt runs planned, then one call per run."""

    def start(self, total: int) -> None: ...

    def advance(self, label: str) -> None: ...


def validate_model(path: str | os.PathLike, options: ValidationOptions | None = None,
                   progress: Progress | None = None) -> Report:
    """Run every check that `options` selects on the decoder at `path` (a file or a folder).

    Raises ModelLoadError when the model (or the reference) cannot be read at all, ConfigError
    for impossible options or a reference that cannot be compared (agreement, rule 1) and
    ProviderError when the provider asked for cannot run here.
    """
    options = options or ValidationOptions()
    subject = load_subject(path)
    if subject.static is None:
        _refuse_static_options(options, subject.path)
    elif options.reference is not None:
        raise ConfigError(f"reference (--reference) compares dynamic decoders, and "
                          f"{str(subject.path)!r} is a static one; drop it")
    elif options.threads is not None:
        raise ConfigError(f"threads (--threads) sets the runtime's sessions, and "
                          f"{str(subject.path)!r} is a static decoder, which runs ONNX Runtime's "
                          f"default threads; drop it")
    compared = _selected(options, REFERENCE)
    reference = None
    if options.reference is not None and any(compared(check) for check in CHECKS[REFERENCE]):
        reference = open_reference(options.reference, subject)
    device = resolve_device(options.provider)
    on_cpu = device.provider == "cpu"
    advance = progress.advance if progress is not None else _ignore
    results: dict[str, CheckResult] = {}
    if subject.static is not None:
        check_fixed_sizes(subject.static, subject.path, chunk_size=options.chunk_size)
        names = [full_name(STRUCTURE, check) for check in STATIC_STRUCTURE] + [
            full_name(STATIC, check) for check in CHECKS[STATIC]]
        watch = Stopwatch(STRUCTURE)
        if _selected(options, STRUCTURE)("checker"):
            _keep(results, [check_checker(subject, watch)])
        watch.restart()
        if _selected(options, STRUCTURE)("external_data"):
            _keep(results, [check_external_data(subject, watch)])
        settings = StaticSettings(
            provider=device.provider, max_input_len=options.max_input_len,
            decode_model=options.decode_model, lengths=options.lengths,
            new_tokens=options.new_tokens, seed=options.seed,
            atol=options.atol if options.atol is not None else
            (STATIC_ATOL if on_cpu else DEVICE_ATOL), atol_given=options.atol is not None)
        selected = _selected(options, STATIC)
        if progress is not None:
            progress.start(planned_runs(subject, settings) if selected("chunked_vs_whole")
                           else 0)
        if subject.external_data_error is None:
            _keep(results, static_checks(subject, settings, selected, advance))
        else:
            _keep(results, _not_runnable(STATIC, selected, "the weights cannot be loaded (see "
                                         "structure.external_data)"))
    else:
        groups = (STRUCTURE, NUMERICS, CACHE, ENGINE,
                  *((REFERENCE,) if options.reference is not None else ()))
        names = [full_name(group, check) for group in groups for check in CHECKS[group]]
        structure, plan = structure_checks(subject, _selected(options, STRUCTURE))
        _keep(results, structure)
        blocker = _runtime_blocker(subject, plan)
        numerics, cache = _selected(options, NUMERICS), _selected(options, CACHE)
        engine = _selected(options, ENGINE)
        wants_numerics = any(numerics(check) for check in CHECKS[NUMERICS])
        wants_cache = any(cache(check) for check in CHECKS[CACHE])
        wants_engine = any(engine(check) for check in CHECKS[ENGINE])
        if blocker is not None:
            if progress is not None:
                progress.start(0)
            for group, selected in ((NUMERICS, numerics), (CACHE, cache), (ENGINE, engine),
                                    (REFERENCE, compared)):
                _keep(results, _not_runnable(group, selected, blocker))
        elif wants_numerics or wants_cache or wants_engine or reference is not None:
            assert plan is not None
            run_settings = _run_settings(plan, options, device.provider,
                                     CPU_ATOL if on_cpu else DEVICE_ATOL)
            runs = len(run_settings.lengths)
            if progress is not None:
                progress.start(len(MODES) * runs * wants_numerics + 2 * runs * wants_cache
                               + engine_runs_planned(run_settings) * wants_engine
                               + 2 * runs * (reference is not None))
            compared_runs: tuple[ReferenceModel, list[ReferenceSteps], RunSettings] | None = None
            if reference is not None:
                # First and alone: only its rows and tokens are kept (agreement, rule 2).
                shared = fitted_settings(reference, run_settings)
                compared_runs = (reference, reference_steps(reference, shared, advance), shared)
            if wants_numerics:
                _keep(results, numerics_checks(subject.path, run_settings, numerics, advance))
            if wants_cache or wants_engine:
                # One runtime, loaded as `serve` loads it, for both groups.
                served = _served_runtime(subject.path, run_settings)
                try:
                    _keep(results, cache_checks(served, run_settings, cache, advance))
                    _keep(results, engine_checks(served, run_settings, engine, advance))
                finally:
                    if not isinstance(served, OnnxChunkError):
                        served.close()
            if compared_runs is not None:
                _keep(results, reference_checks(subject.path, *compared_runs,
                                                options.thresholds, compared, advance))
    report = Report(model=str(path))
    for name in names:
        report.checks.append(results.get(name) or CheckResult(
            name, name.split(".", 1)[0], Outcome.SKIPPED, "skipped (--skip)"))
    return report


def _served_runtime(model_path: Path, settings: RunSettings) -> Runtime | OnnxChunkError:
    """The runtime `serve` loads (its default slots, the provider's sessions and padding), or
    the error that loading it raised (the checks that use it fail with its message)."""
    try:
        return load_runtime(model_path, settings, chunk_size=settings.chunk_size, padding=None,
                            max_batch=ENGINE_SLOTS)
    except OnnxChunkError as error:
        return error


def _ignore(label: str) -> None:
    """The progress callback when nobody watches."""


def _selected(options: ValidationOptions, group: str) -> Callable[[str], bool]:
    return lambda check: full_name(group, check) not in options.skip


def _keep(results: dict[str, CheckResult], checks: list[CheckResult]) -> None:
    results.update((check.name, check) for check in checks)


def _not_runnable(group: str, selected: Callable[[str], bool], reason: str) -> list[CheckResult]:
    return [CheckResult(full_name(group, check), group, Outcome.SKIPPED, reason)
            for check in CHECKS[group] if selected(check)]


def _runtime_blocker(subject: Subject, plan: ChunkPlan | None) -> str | None:
    """Why the runtime cannot be tried on the model at all, or None."""
    if subject.external_data_error is not None:
        return "the weights cannot be loaded (see structure.external_data)"
    if plan is None:
        return "the passes cannot analyse the model (see structure.kv_capacity)"
    if plan.gqa_nodes == 0 and not plan.capacity_inputs:
        return "no GroupQueryAttention node, so the KV cache cannot be bound (see structure.gqa)"
    return None


def _refuse_static_options(options: ValidationOptions, path: Path) -> None:
    given = [name for name, value in (("max_input_len (--max-input-len)", options.max_input_len),
                                      ("decode_model (--decode-model)", options.decode_model))
             if value is not None]
    if given:
        raise ConfigError(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} "
                          "to static decoders only, and "
                          f"{str(path)!r} is a dynamic one; drop them")


def _run_settings(plan: ChunkPlan, options: ValidationOptions, provider: str,
                  default_atol: float) -> RunSettings:
    chunk_size = options.chunk_size or plan.chunk_size or DEFAULT_CHUNK_SIZE
    limit = plan.max_sequence_length
    new_tokens = options.new_tokens
    if limit is not None and new_tokens >= limit:
        raise ConfigError(f"{new_tokens} new tokens leave no room for a prompt within the "
                          f"model's maximum sequence length {limit}; generate at most "
                          f"{limit - 1} (--new-tokens)")
    longest = (limit - new_tokens if limit is not None
               else 2 * chunk_size + chunk_size // 3 + 1)
    if options.lengths is None:
        lengths = boundary_lengths(chunk_size, longest)
    else:
        too_long = [length for length in options.lengths if length > longest]
        if too_long:
            raise ConfigError(f"--lengths {', '.join(map(str, too_long))} leave no room for "
                              f"{new_tokens} new tokens within the model's maximum sequence "
                              f"length {limit}; use lengths up to {longest}")
        lengths = tuple(sorted(set(options.lengths)))
    # Room for the longest prompt, its new tokens and a whole ladder tier past them, so that a
    # padded last chunk never has to fall back to its exact width for lack of room; and room
    # for every sliding window, whose cache may not be shorter than the window.
    capacity = max(lengths) + new_tokens + chunk_size
    if limit is not None:
        capacity = min(capacity, limit)
    capacity = max(capacity, window_capacity(plan.capacity_inputs, limit))
    capacity = max(capacity, 2)
    chunk_size = min(chunk_size, capacity)
    exact = options.exact
    return RunSettings(provider=provider, capacity=capacity, chunk_size=chunk_size,
                       lengths=lengths, new_tokens=new_tokens, seed=options.seed,
                       atol=0.0 if exact else options.atol if options.atol is not None
                       else default_atol,
                       atol_given=exact or options.atol is not None, margin=NOISE_MARGIN,
                       tiers=resolve_tiers(plan, chunk_size), exact=exact,
                       threads=options.threads)
