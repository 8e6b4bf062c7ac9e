"""The batch engine: the prompts as a server runs them, several at once.

`onnx-chunk serve` answers every request through the batch engine (`Runtime.submit`): prefill
chunks per slot, then one decode forward over every slot. The runtime is loaded as the server
loads it, with the server's default slot count, and the seeded prompts run through it twice:
each prompt alone, then all of them submitted at once (each generating enough tokens that the
first prompts still decode while the last are admitted). At a fixed slot count every decode
forward has the same number of rows whatever the other slots hold, so a request's greedy
tokens must not depend on which requests share its steps: the batched tokens must equal the
lone ones.

Across slot counts nothing that strong holds: a kernel may be chosen by the number of rows
(MatMulNBits on an INT4 decoder picks another kernel for 8 rows than for 1), so a near-tie
between two tokens can fall the other way. The same prompts through one sequence (one row per
decode) are compared and reported, not failed: where the tokens part, the single-slot run's
logit margin (top-1 minus top-2) at that step says how near the tie was. In exact mode
(`--exact`) the kernels a decode row runs do not depend on the slot count either
(docs/row_grouping.md): there the one sequence's tokens must equal the batched ones too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnx_chunk import Runtime
from onnx_chunk.errors import OnnxChunkError
from onnx_chunk.runtime import Request
from onnx_chunk.validate.checks import ENGINE
from onnx_chunk.validate.prompts import seeded_prompt
from onnx_chunk.validate.report import CheckResult, Outcome
from onnx_chunk.validate.runs import Advance, RunSettings, greedy_generation, margin

# The slots `onnx-chunk serve` gives the engine by default (its --batch).
ENGINE_SLOTS = 4
# No stop id: every run generates all its new tokens, as the numerics runs do.
_NO_STOP: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineRuns:
    """Each prompt's greedy tokens alone on the engine, batched on it, and through one
    sequence (one decode row), with the sequence's logit margin at every step."""

    slots: int
    alone: list[list[int]]
    batched: list[list[int]]
    single: list[list[int]]
    margins: list[list[float]]
    batched_rows: float | None
    """Mean rows that really decoded per batched forward of the batched pass (the engine's
    own counters): above 1 when prompts did share steps."""


def engine_runs_planned(settings: RunSettings) -> int:
    """Progress steps of the engine check: each prompt alone, the batch, each sequence."""
    return 2 * len(settings.lengths) + 1


def engine_checks(runtime: Runtime | OnnxChunkError, settings: RunSettings,
                  selected: Callable[[str], bool], advance: Advance) -> list[CheckResult]:
    """The selected engine checks (batched_decode) on the served runtime (loaded with
    ENGINE_SLOTS slots), or the error that loading it raised."""
    if not selected("batched_decode"):
        return []
    started = time.perf_counter()
    details: dict[str, Any]
    try:
        if isinstance(runtime, OnnxChunkError):
            raise runtime
        runs = _run_engine(runtime, settings, advance)
    except OnnxChunkError as error:
        outcome, reason, details = (Outcome.FAILED,
                                    f"the runtime cannot run the model: {error}", {})
    except RuntimeError as error:  # ONNX Runtime's own failures of a batched forward
        outcome, reason, details = (Outcome.FAILED, f"ONNX Runtime failed on the model in the "
                                    f"batch engine ({ENGINE_SLOTS} slots): {error}", {})
    else:
        outcome, reason, details = batched_decode_verdict(runs, settings)
        # What the runs moved between host and device (0 on CPU's host path), counted at
        # the copy and sync sites (runtime/device/transfers.py).
        details["transfers"] = dataclasses.asdict(runtime.stats.transfers)
    return [CheckResult(f"{ENGINE}.batched_decode", ENGINE, outcome, reason,
                        time.perf_counter() - started, details)]


def _run_engine(runtime: Runtime, settings: RunSettings, advance: Advance) -> EngineRuns:
    slots = runtime.stats.max_batch
    prompts = [seeded_prompt(runtime.stats.vocab_size, length, settings.seed)
               for length in settings.lengths]
    counts = engine_new_tokens(settings, runtime.stats.chunk_size, runtime.stats.capacity)
    alone = []
    for length, prompt, count in zip(settings.lengths, prompts, counts):
        alone.append(_submit(runtime, prompt, count).result())
        advance(f"engine alone {length}")
    before = _decode_counters(runtime)
    requests = [_submit(runtime, prompt, count) for prompt, count in zip(prompts, counts)]
    batched = [request.result() for request in requests]
    forwards, rows = (after - first
                      for after, first in zip(_decode_counters(runtime), before))
    advance("engine batch")
    single, margins = [], []
    for length, prompt, count in zip(settings.lengths, prompts, counts):
        tokens, step_margins = _one_sequence(runtime, prompt, count)
        single.append(tokens)
        margins.append(step_margins)
        advance(f"engine one slot {length}")
    return EngineRuns(slots, alone, batched, single, margins, rows / forwards if forwards else None)


def engine_new_tokens(settings: RunSettings, chunk_size: int, capacity: int) -> list[int]:
    """Each prompt's new tokens in the engine runs: the numerics' count plus one per engine
    step that admitting every prompt takes (its prefill chunks), so that the first prompts are
    still decoding when the last ones start and the prompts really share decode steps; never
    past the capacity."""
    admitting = sum(-(-length // chunk_size) for length in settings.lengths)
    return [max(1, min(settings.new_tokens + admitting, capacity - length))
            for length in settings.lengths]


def _submit(runtime: Runtime, prompt: np.ndarray, new_tokens: int) -> Request:
    return runtime.submit(prompt, new_tokens, eos_token_id=_NO_STOP, wait=True)


def _decode_counters(runtime: Runtime) -> tuple[int, int]:
    """The engine's batched decode forwards and the rows that really decoded in them."""
    engine = runtime.stats.engine
    return (0, 0) if engine is None else (engine.decode_steps, engine.decode_rows)


def _one_sequence(runtime: Runtime, prompt: np.ndarray,
                  new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of `prompt` through one sequence (its one-slot request), and the top-1
    minus top-2 logit margin of the row each was chosen from."""
    with runtime.open_sequence() as sequence:
        generation = greedy_generation(sequence, prompt, new_tokens)
    return list(generation.tokens), [margin(row) for row in generation.rows]


def _first_difference(first: list[int], second: list[int]) -> int | None:
    for step, (a, b) in enumerate(zip(first, second)):
        if a != b:
            return step
    return None if len(first) == len(second) else min(len(first), len(second))


def batched_decode_verdict(runs: EngineRuns,
                           settings: RunSettings) -> tuple[Outcome, str, dict]:
    """engine.batched_decode's verdict: the batched tokens must be the lone ones; where one
    sequence's part from them, reported with its margin."""
    lengths = list(settings.lengths)
    parted = []
    for length, tokens, single, margins in zip(lengths, runs.batched, runs.single,
                                               runs.margins):
        step = _first_difference(tokens, single)
        if step is not None:
            parted.append({"length": length, "step": step,
                           "single_slot_margin": margins[min(step, len(margins) - 1)]})
    details = {"slots": runs.slots, "lengths": lengths,
               "batched_rows_per_decode_step": runs.batched_rows,
               "tokens": {"alone": runs.alone, "batched": runs.batched,
                          "one_slot": runs.single},
               "one_slot_differences": parted}
    for length, alone, batched in zip(lengths, runs.alone, runs.batched):
        if alone != batched:
            return (Outcome.FAILED, f"at {runs.slots} slots the prompt of length {length} "
                    f"gives {batched} when batched with the others but {alone} alone: a "
                    "request's tokens depend on which requests share its steps", details)
    if parted and settings.exact:
        entry = parted[0]
        return (Outcome.FAILED, f"in exact mode the prompt of length {entry['length']} gives "
                f"other tokens through one sequence (one decode row) than batched on "
                f"{runs.slots} slots, from step {entry['step']}: a decode row's numbers depend "
                "on the slot count here", details)
    if parted:
        across = (f"{len(parted)} of {len(lengths)} part from one sequence's (one decode row), "
                  "at logit margins " + ", ".join(f"{entry['single_slot_margin']:.3g} (length "
                                                  f"{entry['length']}, step {entry['step']})"
                                                  for entry in parted))
    else:
        across = "and equal one sequence's (one decode row)"
    rows = ("" if runs.batched_rows is None
            else f" ({runs.batched_rows:.2g} decoding rows per forward)")
    return (Outcome.PASSED, f"{len(lengths)} prompts batched on {runs.slots} slots{rows} give "
            f"their lone greedy tokens ({', '.join(map(str, map(len, runs.batched)))} new "
            f"tokens), {across}", details)
