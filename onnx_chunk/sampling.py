"""Token choice: greedy, or a seeded draw after the logits processors transformers applies.

`Sampling` is the configuration (validated once, at construction); a `Sampler` is one request's
state: its own random generator and one work buffer allocated up front, so a decode step
allocates nothing the size of the vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from onnx_chunk.errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from a logits row.

    temperature: 0 chooses greedily (argmax, the lowest id on ties); above 0 the logits are
        divided by it and a token is drawn.
    top_k: keep the k highest logits (0: all); 1 is greedy.
    top_p: keep the smallest set of highest-probability tokens whose mass reaches top_p (1: all).
    min_p: drop tokens whose probability is below min_p times the top token's (0: none).
    repetition_penalty: on the tokens already seen (prompt and generated), divide positive
        logits and multiply negative ones by it (1: off); applied in greedy choice too.
    seed: the random generator's seed (None: fresh entropy, not reproducible).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        _number(self.temperature, "temperature", "a number >= 0 (0 is greedy)",
                lambda value: value >= 0)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) \
                or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 keeps every token), got "
                              f"{self.top_k!r}")
        _number(self.top_p, "top_p", "a number in (0, 1] (1 keeps every token)",
                lambda value: 0 < value <= 1)
        _number(self.min_p, "min_p", "a number in [0, 1] (0 keeps every token)",
                lambda value: 0 <= value <= 1)
        _number(self.repetition_penalty, "repetition_penalty", "a number > 0 (1 is off)",
                lambda value: value > 0)
        if self.seed is not None and (isinstance(self.seed, bool) or
                                      not isinstance(self.seed, (int, np.integer))
                                      or self.seed < 0):
            raise ConfigError(f"seed must be a non-negative integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """Whether the choice is the argmax (temperature 0 or top_k 1): no draw."""
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def from_search(cls, search: Mapping[str, Any], **overrides: Any) -> Sampling:
        """The defaults of a genai_config.json `search` section, with `overrides` applied.

        As onnxruntime-genai reads it: `do_sample` false (its default) is greedy; otherwise
        `temperature`, `top_k`, `top_p`, `repetition_penalty` and `random_seed` (-1: none)
        apply. An override that is None leaves the default.
        """
        unknown = sorted(set(overrides) - {field.name for field in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown sampling option(s) {', '.join(unknown)}; expected "
                              f"some of {', '.join(field.name for field in fields(cls))}")
        base = cls(repetition_penalty=_search_value(search, "repetition_penalty", 1.0))
        if search.get("do_sample") is True:
            seed = _search_value(search, "random_seed", -1)
            base = replace(base, temperature=_search_value(search, "temperature", 1.0),
                           top_k=_search_value(search, "top_k", 0),
                           top_p=_search_value(search, "top_p", 1.0),
                           seed=None if seed == -1 else seed)
        given = {name: value for name, value in overrides.items() if value is not None}
        return replace(base, **given)


# Kept tokens up to which a draw gathers them (a [kept] allocation) instead of running over
# the whole row in place.
_GATHERED_DRAW = 4096


class Sampler:
    """One request's token choice under a `Sampling`: seeded, with a preallocated work buffer.

    The order of operations is transformers' logits processors: repetition penalty on the
    tokens seen, temperature, top-k, top-p, min-p, then a draw from what is left. Every token
    whose processed logit reaches the strictest of the three cut-offs stays (ties at a cut-off
    are kept together).
    """

    def __init__(self, sampling: Sampling, vocab_size: int) -> None:
        self.sampling = sampling
        self._rng = np.random.default_rng(sampling.seed)
        self._penalize = sampling.repetition_penalty != 1.0
        self._seen: set[int] = set()
        self._seen_ids = np.empty(0, dtype=np.int64)
        # Row 0: the processed logits, then the weights; row 1: their sorted copy; row 2: the
        # top-p weights, then the mask of the tokens kept.
        self._work = (None if sampling.greedy and not self._penalize
                      else np.empty((3, vocab_size), dtype=np.float64))
        self._mask = None if self._work is None else np.empty(vocab_size, dtype=bool)

    def observe(self, token_ids: Iterable[int]) -> None:
        """Count `token_ids` as seen (for the repetition penalty)."""
        if not self._penalize:
            return
        new = [int(token) for token in token_ids if int(token) not in self._seen]
        if new:
            self._seen.update(new)
            self._seen_ids = np.fromiter(sorted(self._seen), dtype=np.int64,
                                         count=len(self._seen))

    def choose(self, logits: np.ndarray, draft: int | None = None) -> int:
        """The next token for a [vocab] logits row; it counts as seen from now on.

        `draft`: a token proposed for this position (speculative decoding). A greedy choice
        ignores it (the argmax either is the draft or is not); a draw keeps it with its
        probability p(draft) and otherwise draws from p with the draft removed, so the token
        returned is distributed exactly as without a draft.
        """
        if self._work is None:
            return int(np.argmax(logits))
        token = self._choose(logits, draft)
        self.observe((token,))
        return token

    def lead(self, logits: np.ndarray) -> float:
        """How far the best processed score of a [vocab] row leads the runner-up (the
        repetition penalty applied; before temperature)."""
        scores = logits
        if self._penalize and self._seen_ids.size:
            scores = self._work[0]
            np.copyto(scores, logits)
            seen = scores[self._seen_ids]
            penalty = self.sampling.repetition_penalty
            scores[self._seen_ids] = np.where(seen > 0, seen / penalty, seen * penalty)
        top = np.partition(scores, scores.size - 2)[-2:]
        return float(top[1] - top[0])

    def _choose(self, logits: np.ndarray, draft: int | None) -> int:
        sampling = self.sampling
        scores, ascending, scratch = self._work
        np.copyto(scores, logits)
        if self._penalize and self._seen_ids.size:
            seen = scores[self._seen_ids]
            penalty = sampling.repetition_penalty
            scores[self._seen_ids] = np.where(seen > 0, seen / penalty, seen * penalty)
        if sampling.greedy:
            return int(np.argmax(scores))
        scores /= sampling.temperature
        top = float(scores.max())
        cutoff = -math.inf
        vocab = scores.size
        if 0 < sampling.top_k < vocab:
            # The k-th largest logit, by a partition instead of a sort (ties kept by >=).
            np.copyto(ascending, scores)
            ascending.partition(vocab - sampling.top_k)
            cutoff = float(ascending[vocab - sampling.top_k])
        if sampling.top_p < 1.0:
            cutoff = _top_p_cutoff(scores, cutoff, top, sampling.top_p, ascending, scratch,
                                   self._mask)
        if sampling.min_p > 0.0:
            cutoff = max(cutoff, top + math.log(sampling.min_p))
        if not math.isfinite(top):
            raise ValueError(f"the logits hold no finite maximum ({top}): the model's output is "
                             "broken at this step (NaN or infinities), nothing can be sampled")
        np.greater_equal(scores, cutoff, out=self._mask)
        if np.count_nonzero(self._mask) > _GATHERED_DRAW:
            # Many tokens left: draw over the whole row in place (the dropped ones weigh 0).
            scores -= top
            np.exp(scores, out=scores)
            scores *= self._mask
            if draft is not None and self._keeps_draft(scores, draft):
                return draft
            np.cumsum(scores, out=scores)
            return int(np.searchsorted(scores, self._rng.random() * scores[-1], side="right"))
        # A few left: draw among them only, in id order (the same choice as the whole row).
        kept = np.flatnonzero(self._mask)
        weights = np.exp(scores[kept] - top)
        if draft is not None:
            where = int(np.searchsorted(kept, draft))
            if where < kept.size and kept[where] == draft:
                if self._keeps_draft(weights, where):
                    return draft
        np.cumsum(weights, out=weights)
        target = self._rng.random() * weights[-1]
        return int(kept[min(int(np.searchsorted(weights, target, side="right")),
                            kept.size - 1)])

    def _keeps_draft(self, weights: np.ndarray, index: int) -> bool:
        """Keep the drafted token at `index` of `weights` with its probability; else zero its
        weight, so the draw that follows is from the rest renormalised (the rejection rule)."""
        weight = float(weights[index])
        if self._rng.random() * float(weights.sum()) < weight:
            return True
        weights[index] = 0.0
        return False


def _top_p_cutoff(scores: np.ndarray, cutoff: float, top: float, top_p: float,
                  ascending: np.ndarray, weights: np.ndarray, mask: np.ndarray) -> float:
    """The lowest logit top-p keeps of `scores` above `cutoff` (top-k's).

    transformers drops the tokens whose ascending cumulative probability (over what the other
    cut-offs kept) is at most 1 - top_p, and always keeps the most likely one. Only the
    largest logits are sorted: the m largest, doubling m until the mass outside them is at
    most 1 - top_p of the whole, so the cut falls among them.
    """
    vocab = scores.size
    np.less(scores, cutoff, out=mask)
    kept = vocab - int(np.count_nonzero(mask))
    if kept <= _GATHERED_DRAW:
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


def _number(value: object, name: str, expected: str, valid) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or not valid(value):
        raise ConfigError(f"{name} must be {expected}, got {value!r}")


def _search_value(search: Mapping[str, Any], key: str, default: Any) -> Any:
    value = search.get(key, default)
    return default if value is None else value


# The default: argmax, as the runtime chose before sampling existed.
GREEDY = Sampling()
