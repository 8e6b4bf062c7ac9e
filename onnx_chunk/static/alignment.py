"""Aligning a prompt to a static decoder: left-pad a short prompt, left-truncate a long one.

A decoder exported with fixed shapes takes chunks of exactly c
rows, so a prompt is aligned before it is cut into chunks: rounded up to a multiple of c by
left padding, and capped at the longest input L (max_input_len) by left truncation. Three sizes
pull against each other and are checked once, up front (`StaticLimits`):

- L, the longest aligned prompt: too small and prompts get truncated (lossy), too large and the
  graphs and each chunk's activations grow.
- c, the chunk size: too small and prefill loops many times, too large and one chunk's attention
  (c x C scores per head) may not fit in memory.
- C, the KV capacity: must satisfy C >= L, and C - L is the room left to decode, so
  C = L + max_new_tokens (`suggest_capacity`); L == C leaves no room at all.

Alignment is lossless when it pads and lossy when it truncates; truncation is logged with the
numbers and recorded in the result, and refused in strict mode. Where the padding goes depends
on the graph's cache layout (`PadSide`): on the left for an additive mask, which can hide any
position; on the right for GroupQueryAttention bound at capacity, which reads the valid length
off its mask and so needs the real tokens first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from onnx_chunk.errors import CapacityError, ConfigError, InputError

logger = logging.getLogger(__name__)


def suggest_capacity(max_input_len: int, max_new_tokens: int) -> int:
    """The KV capacity that holds the longest prompt and every token generated after it."""
    if max_input_len < 1 or max_new_tokens < 1:
        raise ConfigError(
            f"max input length and max new tokens must be at least 1, got {max_input_len} "
            f"and {max_new_tokens}"
        )
    return max_input_len + max_new_tokens


@dataclass(frozen=True)
class StaticLimits:
    """The three sizes of a static decoder: L (max_input_len), c (chunk_size), C (capacity).

    Rules, checked on construction:
    1. All three are at least 1 and c <= C.
    2. C >= L: the cache holds the longest aligned prompt.
    3. L < C: the L == C trap leaves no room to decode.
    4. c divides L: the longest aligned prompt is a whole number of chunks.
    """

    max_input_len: int
    chunk_size: int
    capacity: int

    def __post_init__(self) -> None:
        max_len, rows, cap = self.max_input_len, self.chunk_size, self.capacity
        if min(max_len, rows, cap) < 1:
            raise ConfigError(
                f"max input length, chunk size and capacity must all be at least 1, got "
                f"L={max_len}, c={rows}, C={cap}"
            )
        if rows > cap:
            raise ConfigError(
                f"chunk size c={rows} exceeds the KV capacity C={cap}; a chunk's keys are the "
                "last C positions, so use c <= C"
            )
        if cap < max_len:
            raise ConfigError(
                f"KV capacity C={cap} is smaller than the max input length L={max_len}; the cache "
                f"must hold the whole aligned prompt: use C >= L, e.g. C = L + max_new_tokens "
                f"(suggest_capacity)"
            )
        if cap == max_len:
            raise ConfigError(
                f"max input length L equals the KV capacity C={cap}: a full prompt leaves no room "
                f"to decode; lower L or raise C to L + max_new_tokens"
            )
        if max_len % rows:
            lower = max_len - max_len % rows
            raise ConfigError(
                f"max input length L={max_len} is not a multiple of the chunk size c={rows}; a "
                f"prompt aligned to L could not be cut into whole chunks: use L={lower or rows} "
                f"or L={lower + rows}"
            )

    @property
    def decode_room(self) -> int:
        """Positions left for generated tokens after the longest prompt: C - L."""
        return self.capacity - self.max_input_len


class PadSide(Enum):
    """Where an aligned prompt's padding goes."""

    LEFT = "left"
    """Pad tokens before the prompt, masked out (an additive mask hides any position)."""
    RIGHT = "right"
    """The last real token repeated after the prompt, as ladder padding does: later positions
    overwrite those rows (GroupQueryAttention counts the valid length off its mask)."""


@dataclass(frozen=True)
class PaddedRows:
    """Real rows widened to a fixed row count: the ids, which rows are real, their positions."""

    input_ids: np.ndarray
    valid: np.ndarray
    position_ids: np.ndarray

    @property
    def pad_count(self) -> int:
        return int(np.count_nonzero(~self.valid))


def pad_rows(ids: np.ndarray, first_position: int, width: int, pad_side: PadSide,
             pad_id: int) -> PaddedRows:
    """`ids`, real tokens at positions first_position, first_position + 1, ..., widened to
    `width` rows: the padding of an aligned prompt and of each static forward.

    Rules:
    1. On the left: `pad_id` before the ids, at position 0 (only a sequence's first rows are
       left padded).
    2. On the right: the last id repeated after them, the positions continuing.
    3. Padding is not valid; ConfigError when the ids are empty or more than `width`.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    real = len(ids)
    if not 1 <= real <= width:
        raise ConfigError(f"cannot pad {real} real rows to {width}; expected 1 to {width}")
    pad = width - real
    if pad_side is PadSide.RIGHT:
        return PaddedRows(np.concatenate([ids, np.repeat(ids[-1:], pad)]),
                          np.arange(width) < real,
                          np.arange(first_position, first_position + width, dtype=np.int64))
    positions = np.zeros(width, dtype=np.int64)
    positions[pad:] = np.arange(first_position, first_position + real)
    return PaddedRows(np.concatenate([np.full(pad, pad_id, dtype=np.int64), ids]),
                      np.arange(width) >= pad, positions)


@dataclass(frozen=True)
class AlignedPrompt:
    """A prompt aligned to whole chunks: the kept prompt tokens and the padding around them."""

    input_ids: np.ndarray
    """int64 [aligned_len]: the kept prompt tokens with pad_count padding rows on one side."""
    valid: np.ndarray
    """bool [aligned_len]: False on padding."""
    position_ids: np.ndarray
    """int64 [aligned_len]: 0, 1, ... on the kept prompt tokens; 0 on left padding, the
    continuing positions on right padding."""
    prompt_len: int
    pad_count: int
    truncated_count: int
    """Prompt tokens dropped from the left to fit L; lost context."""

    @property
    def aligned_len(self) -> int:
        return len(self.input_ids)

    @property
    def kept_len(self) -> int:
        return self.prompt_len - self.truncated_count


def align_prompt(
    prompt_ids: Sequence[int] | np.ndarray,
    limits: StaticLimits,
    *,
    pad_id: int = 0,
    strict: bool = False,
    pad_side: PadSide = PadSide.LEFT,
) -> AlignedPrompt:
    """Align `prompt_ids` to a multiple of the chunk size, capped at the max input length.

    Rules:
    1. A prompt of n <= L tokens is padded to ceil(n / c) * c: on the left with `pad_id`, or
       on the right with its last token repeated (`pad_side`).
    2. A prompt of n > L tokens keeps its last L tokens (left truncation); this is logged as a
       warning with the numbers, and raises CapacityError when `strict`.
    3. Padding is not valid (`valid` False); positions count the kept tokens from 0, never the
       left pads; right pads continue the positions (kept, kept + 1, ...).
    """
    ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    prompt_len = len(ids)
    if prompt_len == 0:
        raise InputError("the prompt is empty; a static decoder needs at least one token")
    truncated = max(0, prompt_len - limits.max_input_len)
    if truncated:
        message = (
            f"prompt of {prompt_len} tokens exceeds the max input length L="
            f"{limits.max_input_len}; left truncation drops its first {truncated} tokens"
        )
        if strict:
            raise CapacityError(f"{message}; raise L (and C) or shorten the prompt")
        logger.warning("%s (context lost; raise L to avoid it)", message)
        ids = ids[truncated:]
    kept = len(ids)
    rows = limits.chunk_size
    aligned_len = -(-kept // rows) * rows
    padded = pad_rows(ids, 0, aligned_len, pad_side, pad_id)
    return AlignedPrompt(
        input_ids=padded.input_ids,
        valid=padded.valid,
        position_ids=padded.position_ids,
        prompt_len=prompt_len,
        pad_count=padded.pad_count,
        truncated_count=truncated,
    )
