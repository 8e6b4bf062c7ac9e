"""Log-probabilities of a logits row: a chosen token's, its rank, and the most likely tokens'.

`logprobs_of` is what the sampler gives per chosen token; `prompt_logprobs_of` what a prefill
gives per prompt token (`Sampling.prompt_logprobs`, `echo`). Vectorized over the row: one exp
and an argpartition, never a vocabulary-sized Python loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log-probability and the `top` most likely tokens' at its position.

    `top`: (token id, log-probability) pairs, most likely first (ties: the lower id first);
    `rank`: how many tokens of the row have a log-probability at least the token's (1: the
    most likely; vLLM's rank; None where it was not computed).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


def logprobs_of(scores: np.ndarray, token: int, top: int,
                scratch: np.ndarray | None = None, rank: bool = False) -> TokenLogprobs:
    """The log-softmax of `scores` (a [vocab] row) at `token`, and its `top` largest entries
    (with `rank`, the token's rank too).

    Vectorized: one exp over the row (into `scratch` when given) and an argpartition for the
    top entries, never a vocabulary-sized Python loop.
    """
    peak = float(scores.max())
    if scratch is None:
        scratch = np.empty(scores.size, dtype=np.float64)
    np.subtract(scores, peak, out=scratch)
    np.exp(scratch, out=scratch)
    norm = peak + math.log(float(scratch.sum()))
    position = None
    if rank:
        np.greater_equal(scores, scores[token], out=scratch)
        position = int(np.count_nonzero(scratch))
    return TokenLogprobs(int(token), float(scores[token]) - norm, _top(scores, top, norm),
                         position)


def _top(scores: np.ndarray, top: int, norm: float) -> tuple[tuple[int, float], ...]:
    if top <= 0:
        return ()
    top = min(top, scores.size)
    ids = np.argpartition(scores, scores.size - top)[scores.size - top:]
    ids = ids[np.lexsort((ids, -scores[ids]))]
    return tuple((int(index), float(scores[index]) - norm) for index in ids)


def prompt_logprobs_of(rows: np.ndarray, following: np.ndarray,
                       top: int) -> list[TokenLogprobs]:
    """For logits `rows` [n, vocab], each row's log-softmax at the token `following` it
    (`following[i]`: the prompt token after row i), its rank and its `top` largest entries."""
    scratch = np.empty(rows.shape[1], dtype=np.float64)
    return [logprobs_of(row, int(token), top, scratch, rank=True)
            for row, token in zip(rows, following)]
