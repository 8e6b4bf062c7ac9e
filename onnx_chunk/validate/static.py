"""Checks of a static (fixed-shape) decoder: graph contract, StaticLimits, chunked vs whole.

A static decoder takes exactly c query rows against a rolling KV cache of C positions (see
docs/static_graph.md). Serving it needs a second graph of the same capacity that takes one
row (the decode graph). Chunked prefill through the chunk graph must give what the unchunked
sequence gives: the decode graph fed one position at a time.

A graph whose MatMulNBits quantize their activations to int8 (`accuracy_level` 4, ONNX
Runtime's CPU kernel) turns the last-ulp differences between a c-row and a one-row forward into
whole quantization steps, so the check takes a wider, measured tolerance for it on the CPU
provider, and greedy tokens may part only at a near-tie (docs/static_graph.md, "Quantized
graphs").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from onnx_chunk.errors import ConfigError, OnnxChunkError
from onnx_chunk.passes.kv_quantization import cache_scales, dequantize
from onnx_chunk.static.alignment import StaticLimits
from onnx_chunk.static.graphs import FED_INPUTS, METADATA_PREFIX, CacheLayout
from onnx_chunk.static.kv_buffers import PAST
from onnx_chunk.static.loading import DECODE_FILE, find_decode_model
from onnx_chunk.static.runner import StaticGenerationResult, StaticRunner
from onnx_chunk.validate.checks import STATIC
from onnx_chunk.validate.prompts import boundary_lengths, seeded_prompt
from onnx_chunk.validate.report import CheckResult, Outcome
from onnx_chunk.validate.runs import Advance
from onnx_chunk.validate.subject import Subject
from onnx_chunk.validate.timing import Stopwatch

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


@dataclass(frozen=True)
class StaticSettings:
    """How the static decoder is exercised."""

    provider: str
    max_input_len: int | None
    decode_model: Path | None
    lengths: tuple[int, ...] | None
    new_tokens: int
    seed: int
    atol: float
    atol_given: bool = False
    """Whether `atol` was asked for (`--atol`): then it holds for every graph."""


INT8_ACTIVATIONS_ATOL = 0.25
"""Tolerance on logits and KV for graphs with int8 activations on the CPU provider: about 3x
the worst gap measured between chunked and one-row runs of the corpus's INT4 exports (0.082 over
684 runs, docs/static_graph.md)."""


def int8_activations(model: ir.Model) -> bool:
    """Whether a com.microsoft MatMulNBits of the graph computes with int8 activations
    (`accuracy_level` 4)."""
    return any(node.op_type == "MatMulNBits" and node.domain == "com.microsoft"
               and node.attributes.get_int("accuracy_level", 0) == 4
               for node in model.graph.all_nodes())


def _tolerance(subject: Subject, settings: StaticSettings) -> tuple[float, bool]:
    """(atol, whether greedy tokens may part at a near-tie) for this graph and provider."""
    if (settings.atol_given or settings.provider != "cpu"
            or not int8_activations(subject.model)):
        return settings.atol, False
    return max(settings.atol, INT8_ACTIVATIONS_ATOL), True


def static_checks(subject: Subject, settings: StaticSettings, selected: Callable[[str], bool],
                  advance: Advance) -> list[CheckResult]:
    """The selected static checks, in order; later ones are skipped when what they need failed."""
    assert subject.static is not None
    watch = Stopwatch(STATIC)
    results: list[CheckResult] = []
    shape = subject.static
    if selected("graph"):
        results.append(watch.result("graph", *_graph(subject)))
    watch.restart()
    limits, limits_verdict = _limits(subject, settings)
    if selected("limits"):
        results.append(watch.result("limits", *limits_verdict))
    watch.restart()
    graphs, decode_verdict = _decode_graph(subject, settings, limits)
    if selected("decode_graph"):
        results.append(watch.result("decode_graph", *decode_verdict))
    watch.restart()
    if selected("chunked_vs_whole"):
        if graphs is None:
            verdict = (Outcome.SKIPPED, "needs valid limits and a decode graph (see "
                       "static.limits and static.decode_graph)", {})
        elif shape.rows == 1:
            verdict = (Outcome.SKIPPED, "the model takes one row per forward: it is a decode "
                       "graph, there is no chunk to compare", {})
        else:
            verdict = _chunked_vs_whole(*graphs, settings, *_tolerance(subject, settings),
                                        advance, cache_scales(subject.model))
        results.append(watch.result("chunked_vs_whole", *verdict))
    return results


def planned_runs(subject: Subject, settings: StaticSettings) -> int:
    """Prompt runs the static checks will make (for a progress bar); 0 when none can run."""
    shape = subject.static
    assert shape is not None
    try:
        limits = StaticLimits(_max_input_len(settings, shape.rows, shape.capacity), shape.rows,
                              shape.capacity)
        return 2 * len(_lengths(settings, limits))
    except ConfigError:
        return 0


def _max_input_len(settings: StaticSettings, rows: int, capacity: int) -> int:
    if settings.max_input_len is not None:
        return settings.max_input_len
    return max((capacity - 1) // rows * rows, 1)


def _lengths(settings: StaticSettings, limits: StaticLimits) -> tuple[int, ...]:
    if settings.lengths is None:
        return boundary_lengths(limits.chunk_size, limits.max_input_len)
    too_long = [length for length in settings.lengths if length > limits.max_input_len]
    if too_long:
        raise ConfigError(f"--lengths {', '.join(map(str, too_long))} exceed the max input "
                          f"length L={limits.max_input_len}; a longer prompt is truncated")
    return settings.lengths


def _graph(subject: Subject) -> tuple[Outcome, str, dict]:
    shape = subject.static
    assert shape is not None
    graph = subject.model.graph
    inputs = {value.name: value for value in graph.inputs}
    outputs = {value.name: value for value in graph.outputs}
    rows, capacity = shape.rows, shape.capacity
    # The rolling layout returns the forward's new K/V; GQA bound at capacity the whole buffer.
    rolling = shape.layout is CacheLayout.ROLLING
    present_len = rows if rolling else capacity
    problems = []
    for name in ("input_ids", "position_ids") if rolling else ("input_ids",):
        if name not in inputs:
            problems.append(f"no {name} input")
        elif _dims(inputs[name]) != [1, rows]:
            problems.append(f"{name} is {_dims(inputs[name])}, expected [1, {rows}]")
    unfed = sorted(name for name in inputs if name not in FED_INPUTS and not _PAST.match(name))
    if unfed:
        problems.append(f"input(s) {', '.join(unfed)} that the static runner cannot feed")
    layers = sorted({int(match.group(1)) for name in inputs if (match := _PAST.match(name))})
    if not layers:
        problems.append("no past_key_values.N.key|value inputs")
    for layer in layers:
        for kind in ("key", "value"):
            past, present = f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}"
            past_dims = _dims(inputs[past]) if past in inputs else None
            if past_dims is None or len(past_dims) != 4 or past_dims[2] != capacity:
                problems.append(f"{past} is {past_dims}, expected [1, kv_heads, {capacity}, "
                                "head_size]")
                continue
            expected = past_dims[:2] + [present_len, past_dims[3]]
            if present not in outputs:
                problems.append(f"no {present} output")
            elif _dims(outputs[present]) != expected:
                problems.append(f"{present} is {_dims(outputs[present])}, expected {expected}")
    if "logits" not in outputs or (_dims(outputs["logits"]) or [None])[:2] != [1, rows]:
        problems.append(f"logits must be [1, {rows}, vocab]")
    declared = {key: subject.model.metadata_props.get(METADATA_PREFIX + key)
                for key in ("chunk_size", "capacity")}
    for key, actual in (("chunk_size", rows), ("capacity", capacity)):
        if declared[key] is not None and declared[key] != str(actual):
            problems.append(f"metadata {METADATA_PREFIX}{key} is {declared[key]} but the graph "
                            f"says {actual}")
    details = {"rows": rows, "capacity": capacity, "layers": len(layers),
               "mask_input": shape.mask_input, "layout": shape.layout.value,
               "problems": problems}
    if problems:
        return Outcome.FAILED, "; ".join(problems), details
    mask = (f"additive mask {shape.mask_input} [1, 1, {rows}, {capacity}]" if rolling
            else f"{shape.mask_input} [1, {capacity}] with the KV bound at capacity")
    return (Outcome.PASSED, f"every dimension fixed: c={rows} rows, capacity C={capacity}, "
            f"{len(layers)} layers, {mask}", details)


def _dims(value: ir.Value) -> list[int | str] | None:
    """The value's dims: sizes, or the names of the dims left free."""
    if value.shape is None:
        return None
    return [dim if isinstance(dim, int) else (dim.value or "?") for dim in value.shape.dims]


def _limits(subject: Subject, settings: StaticSettings) -> tuple[
        StaticLimits | None, tuple[Outcome, str, dict]]:
    shape = subject.static
    assert shape is not None
    max_input_len = _max_input_len(settings, shape.rows, shape.capacity)
    details = {"max_input_len": max_input_len, "chunk_size": shape.rows,
               "capacity": shape.capacity}
    try:
        limits = StaticLimits(max_input_len, shape.rows, shape.capacity)
    except ConfigError as error:
        return None, (Outcome.FAILED, str(error), details)
    positions = subject.model.metadata_props.get(METADATA_PREFIX + "max_positions")
    if positions is not None and positions.isdigit() and int(positions) < shape.capacity:
        return None, (Outcome.FAILED, f"the rotary tables hold {positions} positions but the "
                      f"capacity is C={shape.capacity}; rebuild with C <= {positions}", details)
    return limits, (Outcome.PASSED, f"L={limits.max_input_len}, c={limits.chunk_size}, "
                    f"C={limits.capacity}: c divides L, L < C leaves {limits.decode_room} "
                    "position(s) to decode", details)


def _decode_graph(subject: Subject, settings: StaticSettings,
                  limits: StaticLimits | None) -> tuple[tuple[StaticRunner, Path] | None,
                                                        tuple[Outcome, str, dict]]:
    shape = subject.static
    assert shape is not None
    decode = settings.decode_model
    if decode is None:
        decode = subject.path if shape.rows == 1 else find_decode_model(subject.path)
    if decode is None:
        return None, (Outcome.SKIPPED, f"no decode graph (1 row) given; pass --decode-model "
                      f"or put {DECODE_FILE} beside the model", {})
    if limits is None:
        return None, (Outcome.SKIPPED, "the limits are invalid (see static.limits)",
                      {"decode_model": str(decode)})
    try:
        runner = StaticRunner(subject.path, decode, max_input_len=limits.max_input_len,
                              provider=settings.provider)
    except OnnxChunkError as error:
        return None, (Outcome.FAILED, str(error), {"decode_model": str(decode)})
    spec = runner.decode_spec
    return (runner, decode), (Outcome.PASSED, f"{decode}: 1 row, capacity {spec.capacity}, "
                    f"{spec.num_layers} layers, {runner.kv_dtype} KV cache, as the chunk graph",
                    {"decode_model": str(decode), "kv_dtype": runner.kv_dtype,
                     "kv_bytes": runner.kv_bytes})


def _chunked_vs_whole(runner: StaticRunner, decode: Path, settings: StaticSettings,
                      atol: float, ties_may_part: bool, advance: Advance,
                      scales: dict[str, np.ndarray]) -> tuple[Outcome, str, dict]:
    """Chunked prefill against the decode graph fed one position at a time. A quantized
    cache's K/V are compared as the values the attention reads (`dequantize` with the graph's
    scales), so one quantization step counts as what it is worth, never as a wrapped byte."""
    limits = runner.limits
    lengths = _lengths(settings, limits)
    # The unchunked sequence: every position its own forward through the decode graph.
    whole = StaticRunner(decode, decode,
                         max_input_len=limits.capacity - 1, provider=settings.provider)
    rows = []
    for length in lengths:
        prompt = seeded_prompt(runner.vocab_size, length, settings.seed)
        new_tokens = min(settings.new_tokens, limits.capacity - length + 1)
        chunked_logits, chunked_kv, chunked = _run(runner, prompt, new_tokens, scales)
        advance(f"static chunked {length}")
        whole_logits, whole_kv, reference = _run(whole, prompt, new_tokens, scales)
        advance(f"static whole {length}")
        parted = token_parting(chunked.tokens, reference.tokens, reference.step_logits)
        rows.append({"length": length, "new_tokens": new_tokens,
                     "tokens_equal": parted is None,
                     "chunked_tokens": chunked.tokens, "whole_tokens": reference.tokens,
                     "parted_at": None if parted is None else parted[0],
                     "tie_margin": None if parted is None else parted[1],
                     "logits": float(np.max(np.abs(chunked_logits - whole_logits))),
                     "kv": max(float(np.max(np.abs(a - b))) if a.size else 0.0
                               for a, b in zip(chunked_kv, whole_kv))})
    details = {"lengths": list(lengths), "atol": atol, "int8_activations": ties_may_part,
               "runs": rows}
    ties = []
    for row in rows:
        if not row["tokens_equal"]:
            if not (ties_may_part and row["tie_margin"] <= 2 * atol):
                return (Outcome.FAILED, f"greedy tokens of chunked prefill differ from the "
                        f"unchunked sequence's at prompt length {row['length']}: "
                        f"{row['chunked_tokens']} vs {row['whole_tokens']}"
                        + (f" (the unchunked logits of the two tokens {row['tie_margin']:.3g} "
                           f"apart, more than 2 x atol)" if ties_may_part else ""), details)
            ties.append(row["length"])
        worst = max(row["logits"], row["kv"])
        if not worst <= atol:
            return (Outcome.FAILED, f"chunked prefill's last logits / KV differ from the "
                    f"unchunked sequence's by {worst:.3g} > atol {atol:g} at prompt "
                    f"length {row['length']}", details)
    worst = max(max(row["logits"], row["kv"]) for row in rows)
    scope = (" (int8 activations: MatMulNBits accuracy_level 4)" if ties_may_part else "")
    parted = (f"; tokens parted at a near-tie at length(s) {', '.join(map(str, ties))}"
              if ties else "")
    return (Outcome.PASSED, f"chunks of c={limits.chunk_size} reproduce the unchunked sequence "
            f"(decode graph, one row per position) at lengths {', '.join(map(str, lengths))}: "
            f"same greedy tokens, logits and KV within {worst:.3g} <= atol {atol:g}{scope}"
            f"{parted}", details)


def token_parting(tokens: list[int], reference: list[int], reference_logits: list[np.ndarray]
                  ) -> tuple[int, float] | None:
    """Where greedy `tokens` (as many as `reference`) first part from `reference`, and how far
    apart the reference's logits at that step put the two tokens; None when they agree."""
    for step, (token, expected) in enumerate(zip(tokens, reference, strict=True)):
        if token != expected:
            logits = reference_logits[step]
            return step, float(logits[expected] - logits[token])
    return None


def _run(runner: StaticRunner, prompt: np.ndarray, new_tokens: int,
         scales: dict[str, np.ndarray]
         ) -> tuple[np.ndarray, list[np.ndarray], StaticGenerationResult]:
    """One generation: the prefill's last real row of logits, every layer's K and V over the
    prompt's real positions right after prefill (float values, a quantized cache's
    dequantized), and the greedy result with every step's logits."""
    prefill = runner.start(prompt, new_tokens)
    kv = prefill.cache.recent(prefill.aligned.kept_len)
    layers = runner.chunk_spec.num_layers
    names = [PAST.format(layer, kind) for kind in ("key", "value") for layer in range(layers)]
    kv = [dequantize(array, scales[name]) if array.dtype.kind in "iu" else array
          for name, array in zip(names, kv, strict=True)]
    return prefill.logits, kv, runner.decode(prefill, new_tokens, keep_logits=True)
