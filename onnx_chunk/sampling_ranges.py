"""The one numeric-range rule of the sampling fields, vLLM's, checked where a `Sampling` is built
and declared by the server's request models.

The ranges are those of vLLM's `SamplingParams._verify_args` (vllm/sampling_params.py, read at
commit 00388f65): temperature in [0, 2], top_p in (0, 1], top_k -1, 0 or more (no upper
bound), min_p in [0, 1], presence and frequency penalties in [-2, 2], repetition_penalty any
finite number > 0; its OpenAI protocol bounds `seed` to a signed 64-bit integer (-1: none).
typical_p, which vLLM does not have, is transformers' `TypicalLogitsWarper` mass in (0, 1]
(1: off). Every number must be finite. `RANGES` is the table; `check_number` applies it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnx_chunk.errors import ConfigError

# OpenAI's range of logit_bias values; a bias outside it is clamped (as vLLM does).
MAX_LOGIT_BIAS = 100.0
# A seed is a signed 64-bit integer (vLLM's protocol); -1 asks for fresh entropy.
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True)
class Range:
    """A closed or open interval of numbers (None: unbounded on that side)."""

    low: float | None
    high: float | None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    # What the default or a special value means, shown after the range.
    note: str = ""

    def holds(self, value: object) -> bool:
        """Whether `value` is a number of this range (a boolean is not a number)."""
        if isinstance(value, bool) or not isinstance(
                value, (int, np.integer) if self.integer
                else (int, float, np.integer, np.floating)):
            return False
        if not self.integer and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return bool(self.high is None or (value < self.high if self.high_open
                                          else value <= self.high))

    def describe(self) -> str:
        """What a value must be, as a refusal says it ("a number in (0, 1] (1: off)")."""
        kind = "an integer" if self.integer else "a number"
        if self.low is not None and self.high is not None:
            text = (f"{kind} in {'(' if self.low_open else '['}{_shown(self.low)}, "
                    f"{_shown(self.high)}{')' if self.high_open else ']'}")
        elif self.low is not None:
            text = f"{kind} {'>' if self.low_open else '>='} {_shown(self.low)}"
        else:
            text = kind
        if not self.integer and (self.low is None or self.high is None):
            text = "a finite " + text.removeprefix("a ")
        return f"{text} ({self.note})" if self.note else text

    def constraints(self) -> dict[str, Any]:
        """The range as pydantic Field constraints."""
        found: dict[str, Any] = {} if self.integer else {"allow_inf_nan": False}
        if self.low is not None:
            found["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            found["lt" if self.high_open else "le"] = self.high
        return found


def _shown(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


# The range of every numeric sampling field (vLLM's rule, see the module docstring).
RANGES: dict[str, Range] = {
    "temperature": Range(0, 2, note="0 is greedy"),
    "top_p": Range(0, 1, low_open=True, note="1 keeps every token"),
    "top_k": Range(-1, None, integer=True, note="0 or -1 keeps every token"),
    "min_p": Range(0, 1, note="0 keeps every token"),
    "typical_p": Range(0, 1, low_open=True, note="1 is off"),
    "repetition_penalty": Range(0, None, low_open=True, note="1 is off"),
    "presence_penalty": Range(-2, 2, note="0 is off"),
    "frequency_penalty": Range(-2, 2, note="0 is off"),
    "min_tokens": Range(0, None, integer=True),
    "seed": Range(*SEED_RANGE, integer=True, note="-1 is none"),
}


def check_number(name: str, value: object) -> None:
    """ConfigError unless `value` lies in the range of the sampling field `name`."""
    allowed = RANGES[name]
    if not allowed.holds(value):
        raise ConfigError(f"{name} must be {allowed.describe()}, got {value!r}")


def is_count(value: object) -> bool:
    """Whether `value` is an integer >= 0 (a boolean is not)."""
    return (not isinstance(value, bool) and isinstance(value, (int, np.integer))
            and bool(value >= 0))


def token_ids(value: object, name: str) -> tuple[int, ...]:
    """`value` as token ids (integers >= 0), ConfigError naming `name` otherwise."""
    if not isinstance(value, Iterable):
        raise ConfigError(f"{name} must be token ids (integers >= 0), got {value!r}")
    try:
        ids: tuple[object, ...] = tuple(value)
    except TypeError as error:
        raise ConfigError(f"{name} must be token ids (integers >= 0), got {value!r}") from error
    if not all(is_count(token) for token in ids):
        raise ConfigError(f"{name} must be token ids (integers >= 0), got {ids!r}")
    return tuple(int(token) for token in ids)  # type: ignore[call-overload]


def logit_bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (id, bias) pairs, each bias clamped to [-100, 100]."""
    items: Any = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(token, bias) for token, bias in items]
    except (TypeError, ValueError) as error:
        raise ConfigError(f"logit_bias must map token ids to numbers, got {value!r}") from error
    for token, bias in pairs:
        if not is_count(token):
            raise ConfigError(f"logit_bias keys must be token ids (integers >= 0), got "
                              f"{token!r}")
        if not Range(None, None).holds(bias):
            raise ConfigError(f"logit_bias[{token}] must be a finite number, got {bias!r}")
    if len({int(token) for token, _ in pairs}) < len(pairs):
        raise ConfigError(f"logit_bias names a token id twice: {value!r}")
    return tuple(sorted((int(token), min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(bias))))
                        for token, bias in pairs))
