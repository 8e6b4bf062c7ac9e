"""The native chunk plan: a forward's rows right-padded to one query width, Q real per row.

With GroupQueryAttention's `query_seqlens` input (onnx_chunk.graph.query_seqlens) a forward of
`[batch, S]` query rows carries Q_b real rows per batch row b: only those enter the cache,
rotary positions and the causal or local window follow them, padded output rows are
unspecified, and Q_b = 0 leaves the row's cache as it was. The builder's graphs derive
`seqlens_k` (ReduceSum(attention_mask) - 1) and `total_sequence_length` (the mask's width) from
the mask, so the mask says the rest. What this module plans, for rows at past lengths P_b:

1. Width S: one token per row (a decode) runs at the decode width; otherwise the longest
   stepping row's tokens, rounded up the ladder when padding is on (`padded_width`, within
   the room every row has left: a non-windowed cache needs P_b + S <= capacity for every row,
   idle ones included).
2. Tokens: each row's real tokens, then its last token repeated (an idle row: token 0); the
   padded rows' values are never read back.
3. Positions (a decoder with a position_ids input): P_b + i for every row i < S.
4. query_seqlens: Q_b, the row's real tokens; 0 for an idle row.
5. Mask: row b holds T_b = P_b + Q_b ones (at least 1: the operator needs T >= 1, and an
   idle empty row's one position is read by nobody), zeros after; its width is at least S
   (GroupQueryAttention refuses a total_sequence_length below the query length for a cache
   that is not windowed: measured on ONNX Runtime 1.32) and at least the largest T_b.
6. Logits: row b's last real row is Q_b - 1; lengths advance by Q_b (no rewind: padded rows
   never entered the cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from onnx_chunk.errors import CapacityError, InputError
from onnx_chunk.ladder import DECODE_WIDTH, padded_width


@dataclass(frozen=True)
class NativeRow:
    """One batch row as the plan sees it: real token ids (or embedding rows), its past
    length, whether it steps (an idle row feeds nothing)."""

    tokens: np.ndarray
    past: int
    steps: bool = True


@dataclass(frozen=True)
class NativePlan:
    """One forward's inputs at width S (see the module docstring)."""

    width: int
    tokens: np.ndarray
    positions: np.ndarray
    query_lens: np.ndarray
    mask_ones: np.ndarray
    mask_width: int

    @property
    def padded_rows(self) -> int:
        """Query rows computed that are no row's real token."""
        return int(self.width * len(self.query_lens) - self.query_lens.sum())

    @property
    def last_rows(self) -> np.ndarray:
        """Each batch row's last real row (0 for an idle row, whose logits nobody reads)."""
        return np.maximum(self.query_lens.astype(np.int64) - 1, 0)


def plan_native(rows: Sequence[NativeRow], *, tiers: Sequence[int], capacity: int,
                windowed: bool = False, padding: bool = True) -> NativePlan:
    """Plan one native forward of `rows` (rules of the module docstring).

    `capacity`: the KV capacity; `windowed`: every KV cache the rows touch is window-sized
    (staged inside the operator, so rule 1's room does not bind); `padding`: round S up the
    ladder. CapacityError when a stepping row's tokens do not fit before the capacity;
    InputError for a forward with no stepping row or rows of different token kinds.
    """
    stepping = [row for row in rows if row.steps]
    if not stepping:
        raise InputError("a forward needs at least one row that steps")
    longest = max(len(row.tokens) for row in stepping)
    if longest < 1:
        raise InputError("a stepping row needs at least one token")
    for row in rows:
        if row.past < 0:
            raise InputError(f"the past length must be at least 0, got {row.past}")
        if row.steps and row.past + len(row.tokens) > capacity:
            raise CapacityError(
                f"a forward of {len(row.tokens)} rows at past length {row.past} needs "
                f"{len(row.tokens)} positions but only {capacity - row.past} are left before "
                "the KV capacity; shorten the request or raise the capacity")
    room = None if windowed else capacity - max(row.past for row in rows)
    if room is not None and room < longest:
        raise CapacityError(
            f"a batched forward of {longest} query rows needs {longest} positions past every "
            f"row's length, but a row at length {max(row.past for row in rows)} has only "
            f"{room} left before the KV capacity {capacity}; run the rows apart")
    if longest == DECODE_WIDTH:
        width = DECODE_WIDTH
    else:
        width = padded_width(longest, tiers, room) if padding else longest
    sample = stepping[0].tokens
    tokens = np.zeros((len(rows), width, *sample.shape[1:]), dtype=sample.dtype)
    for index, row in enumerate(rows):
        if not row.steps or not len(row.tokens):
            continue
        count = len(row.tokens)
        if row.tokens.shape[1:] != sample.shape[1:]:
            raise InputError("every row of a forward feeds the same kind of tokens")
        tokens[index, :count] = row.tokens
        tokens[index, count:] = row.tokens[-1]
    pasts = np.array([row.past for row in rows], dtype=np.int64)
    query_lens = np.array([len(row.tokens) if row.steps else 0 for row in rows],
                          dtype=np.int32)
    mask_ones = np.maximum(pasts + query_lens, 1)
    positions = pasts[:, None] + np.arange(width, dtype=np.int64)[None, :]
    return NativePlan(width=width, tokens=tokens, positions=positions, query_lens=query_lens,
                      mask_ones=mask_ones, mask_width=max(width, int(mask_ones.max())))
