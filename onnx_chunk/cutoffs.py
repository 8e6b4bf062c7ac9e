"""The cut-offs of a draw over a logits row: top-p's lowest kept logit, and the locally typical
set. Pure NumPy over preallocated rows; `onnx_chunk.sampling.Sampler` applies them.

Rules:
1. top-p (transformers' `TopPLogitsWarper`): over what the earlier cut-offs kept, drop the
   tokens whose ascending cumulative probability is at most 1 - top_p; the most likely token
   always stays, and ties at the cut stay together (the cut is a logit).
2. typical-p (transformers' `TypicalLogitsWarper`, src/transformers/generation/
   logits_process.py; Meister et al., "Locally Typical Sampling"): over what the earlier
   cut-offs kept, order the tokens by how far their surprise -log p lies from the entropy of
   the distribution, and keep the closest ones until their probability mass reaches
   typical_p (the token that reaches it included, and every token as close as it); the
   closest token always stays. The most likely token may be dropped.
"""

from __future__ import annotations

import math

import numpy as np

# Kept tokens up to which a cut gathers them (a [kept] allocation) instead of running over
# the whole row in place.
GATHERED = 4096


def top_p_cutoff(scores: np.ndarray, cutoff: float, top: float, top_p: float,
                 ascending: np.ndarray, weights: np.ndarray, mask: np.ndarray) -> float:
    """The lowest logit top-p keeps of `scores` above `cutoff` (rule 1).

    Only the largest logits are sorted: the m largest, doubling m until the mass outside them
    is at most 1 - top_p of the whole, so the cut falls among them. `ascending`, `weights`
    and `mask` are work rows of the row's size.
    """
    vocab = scores.size
    np.less(scores, cutoff, out=mask)
    kept = vocab - int(np.count_nonzero(mask))
    if kept <= GATHERED:
        np.logical_not(mask, out=mask)
        largest = np.sort(scores[np.flatnonzero(mask)])
        shares = np.exp(largest - top)
        return _first_kept(largest, shares, 0.0, (1.0 - top_p) * float(shares.sum()), cutoff)
    np.subtract(scores, top, out=weights)
    np.exp(weights, out=weights)
    np.copyto(weights, 0.0, where=mask)
    total = float(weights.sum())
    limit = (1.0 - top_p) * total
    size = min(64, kept)
    while True:
        np.copyto(ascending, scores)
        np.copyto(ascending, -math.inf, where=mask)
        ascending.partition(vocab - size)
        largest = np.sort(ascending[vocab - size:])
        shares = np.exp(largest - top)
        rest = total - float(shares.sum())
        if rest <= limit or size >= kept:
            break
        size = min(2 * size, kept)
    return _first_kept(largest, shares, rest, limit, cutoff)


def _first_kept(largest: np.ndarray, shares: np.ndarray, rest: float, limit: float,
                cutoff: float) -> float:
    """The logit of the first of `largest` (ascending) whose cumulative mass, with the `rest`
    below them, passes `limit`."""
    cumulative = np.cumsum(shares) + rest
    first = int(np.searchsorted(cumulative, limit, side="right"))
    return max(cutoff, float(largest[min(first, largest.size - 1)]))


def keep_typical(scores: np.ndarray, mask: np.ndarray, mass: float) -> None:
    """Narrow `mask` (the tokens kept so far) to the locally typical set of `scores` whose
    probability mass reaches `mass` (rule 2)."""
    kept = np.flatnonzero(mask)
    values = scores[kept]
    logp = values - float(values.max())
    logp -= math.log(float(np.exp(logp).sum()))
    p = np.exp(logp)
    entropy = -float(np.dot(p, logp))
    distance = np.abs(-logp - entropy)
    order = np.argsort(distance, kind="stable")
    cumulative = np.cumsum(p[order])
    last = min(int(np.count_nonzero(cumulative < mass)), order.size - 1)
    dropped = kept[distance > distance[order[last]]]
    mask[dropped] = False
