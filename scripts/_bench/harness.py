"""The pure parts of the benchmark harness: run order, prompts, summaries and ratio tables.

Nothing here touches ONNX Runtime, so every rule is tested without a model.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

PROMPT_LENGTHS = (40, 300, 900, 2000, 4000)
NEW_TOKENS = 32
CHUNK_SIZE = 512
# Token ids 0..2 are pad/bos/eos in the reference decoders; prompts never contain them.
FIRST_PROMPT_ID = 3


def interleaved_order(systems: Sequence[str], repetitions: int) -> list[tuple[int, str]]:
    """The order of (repetition, system) measurements: every system once per round.

    Rules:
    1. `repetitions` rounds; each round runs every system once, so a slow drift of the machine
       touches every system alike instead of one block of runs.
    2. The order inside a round rotates by one system per round (A B C, B C A, C A B, ...), so
       no system always runs first (cold caches) or right after the same neighbour.
    """
    if not systems:
        raise ValueError("at least one system is needed")
    if len(set(systems)) != len(systems):
        raise ValueError(f"system names must be distinct, got {list(systems)}")
    if repetitions < 1:
        raise ValueError(f"at least one repetition is needed, got {repetitions}")
    return [(round_index, system) for round_index in range(repetitions)
            for system in round_order(systems, round_index)]


def round_order(systems: Sequence[str], round_index: int) -> list[str]:
    """The systems of round `round_index`, rotated left by `round_index` places."""
    shift = round_index % len(systems)
    return list(systems[shift:]) + list(systems[:shift])


def seeded_prompt(length: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The prompt of `length` token ids every system gets: seeded by (seed, length)."""
    if length < 1:
        raise ValueError(f"a prompt needs at least one token, got {length}")
    if vocab_size <= FIRST_PROMPT_ID:
        raise ValueError(f"the vocabulary ({vocab_size}) must hold ids above {FIRST_PROMPT_ID}")
    rng = np.random.default_rng([seed, length])
    return [int(token) for token in rng.integers(FIRST_PROMPT_ID, vocab_size, size=length)]


def capped_lengths(lengths: Iterable[int], capacity: int, new_tokens: int) -> list[int]:
    """The prompt lengths that fit: each capped so prompt + new tokens <= capacity, deduplicated."""
    limit = capacity - new_tokens
    if limit < 1:
        raise ValueError(f"capacity {capacity} leaves no room for a prompt and {new_tokens} "
                         "new tokens")
    capped: list[int] = []
    for length in lengths:
        value = min(length, limit)
        if value not in capped:
            capped.append(value)
    return capped


@dataclass(frozen=True)
class Summary:
    """Median and spread of repeated measurements."""

    n: int
    median: float
    low: float
    high: float

    @property
    def spread(self) -> float:
        """(max - min) / median: the relative range of the measurements (0 when n == 1)."""
        if self.median == 0:
            return 0.0
        return (self.high - self.low) / abs(self.median)


def summarize(values: Iterable[float]) -> Summary:
    """Median, minimum and maximum of `values` (at least one)."""
    data = [float(value) for value in values]
    if not data:
        raise ValueError("nothing to summarize: no measurements")
    return Summary(len(data), statistics.median(data), min(data), max(data))


def ratio(numerator: Summary, denominator: Summary) -> float:
    """The ratio of two medians (inf when the denominator's median is 0)."""
    if denominator.median == 0:
        return float("inf")
    return numerator.median / denominator.median


def format_value(summary: Summary, digits: int = 2) -> str:
    """`median ±spread%` (the spread is (max-min)/median)."""
    return f"{summary.median:.{digits}f} ±{100 * summary.spread:.0f}%"


def verdict(value: float, target: float, higher_is_better: bool) -> str:
    """"ok" when `value` meets the target, else "MISS"."""
    met = value >= target if higher_is_better else value <= target
    return "ok" if met else "MISS"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; numbers right-aligned, text left-aligned."""
    if not headers:
        raise ValueError("a table needs at least one column")
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)} has {len(row)} cells, expected {len(headers)}")
    numeric = [bool(rows) and all(_is_number(row[i]) for row in rows)
               for i in range(len(headers))]
    cells = [[_cell(value) for value in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join("---:" if right else "---" for right in numeric) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def decode_rounds(systems: Sequence[str], repetitions: int,
                  run_round: Callable[[str, int], tuple[list[float], int]]
                  ) -> dict[str, list[dict]]:
    """Decode tokens/s of `systems`, interleaved round by round in rotating order:
    `run_round(system, round_index)` serves that round's requests and gives their decode rates
    and the tokens they made. Each round is printed on stderr; the runs, by system."""
    runs: dict[str, list[dict]] = {system: [] for system in systems}
    width = max(len(system) for system in systems)
    for round_index in range(repetitions):
        for system in round_order(systems, round_index):
            rates, tokens = run_round(system, round_index)
            rate = sum(rates) / len(rates)
            runs[system].append({"tokens_per_s": rate, "tokens": tokens})
            print(f"round {round_index + 1}/{repetitions} {system:<{width}} {rate:.1f} tok/s "
                  f"({tokens} tokens)", file=sys.stderr)
    return runs


def decode_ratio_result(runs: dict[str, list[dict]], base: str, other: str, goal: float,
                        description: str, plan: dict, repetitions: int,
                        load_before: tuple[float, float, float]) -> tuple[dict, str]:
    """The data to publish and the table of a `decode_rounds` run: `decode_ratio_table` with a
    line of `description`, the rounds and the load average before and now."""
    load_after = os.getloadavg()
    value, table = decode_ratio_table(runs, base, other, goal)
    table += (f"\n\n{description}, {repetitions} rounds; load average {load_before[0]:.2f} "
              f"before, {load_after[0]:.2f} after")
    return {"plan": plan, "repetitions": repetitions, "runs": runs, "ratio": value,
            "load_average": [load_before, load_after]}, table


def decode_ratio_table(runs: dict[str, list[dict]], base: str, other: str,
                       goal: float) -> tuple[float, str]:
    """`other`'s median decode tokens/s over `base`'s, and the table of both against `goal`
    (a ratio at least that is met)."""
    base_speed = summarize(run["tokens_per_s"] for run in runs[base])
    other_speed = summarize(run["tokens_per_s"] for run in runs[other])
    value = ratio(other_speed, base_speed)
    table = markdown_table(
        ["system", "decode tok/s (median ±spread)", f"ratio to {base}", "goal", "verdict"],
        [[base, format_value(base_speed, 1), 1.0, "", ""],
         [other, format_value(other_speed, 1), value, f">= {goal}",
          verdict(value, goal, True)]])
    return value, table
