"""Token choice: greedy, or a seeded draw after the logits processors transformers applies.

`Sampling` is the configuration (validated once, at construction); a `Sampler` is one request's
state: its own random generator, the counts of the tokens it generated (for the presence and
frequency penalties), its grammar matcher (structured output), and one work buffer allocated
up front, so a decode step allocates nothing the size of the vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol, cast

import numpy as np

from onnx_chunk.cutoffs import GATHERED, keep_typical, top_p_cutoff
from onnx_chunk.errors import ConfigError
from onnx_chunk.sampling_ranges import (
    MAX_LOGIT_BIAS,
    RANGES,
    SEED_RANGE,
    check_number,
    is_count,
    logit_bias_pairs,
    token_ids,
)
from onnx_chunk.token_logprobs import TokenLogprobs, logprobs_of, prompt_logprobs_of

__all__ = ["GREEDY", "MAX_LOGIT_BIAS", "RANGES", "Constraint", "ConstraintMatcher", "Sampler",
           "Sampling", "TokenLogprobs", "logprobs_of", "prompt_logprobs_of"]


class ConstraintMatcher(Protocol):
    """One request's place in a grammar: which tokens may come next, advanced token by token."""

    def restrict(self, scores: np.ndarray) -> None:
        """Set the scores of the tokens the grammar forbids now to -inf (in place)."""

    def advance(self, token: int) -> None:
        """Move past `token` (one the last `restrict` allowed)."""


class Constraint(Protocol):
    """A compiled grammar the output must follow (onnx_chunk.structured builds them)."""

    def matcher(self) -> ConstraintMatcher:
        """A new matcher at the grammar's start, for one request."""


# Temperatures below this choose greedily: dividing logits by less overflows them (a 1e-310
# temperature turns every logit into an infinity), and the draw would be the argmax anyway.
GREEDY_TEMPERATURE = 1e-5

@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from a logits row. Every numeric field is checked against
    `RANGES`, vLLM's one rule (onnx_chunk/sampling_ranges.py).

    temperature: in [0, 2]; under GREEDY_TEMPERATURE (1e-5), 0 included, chooses greedily
        (argmax, the lowest id on ties); above it the logits are divided by it and a token is
        drawn.
    top_k: keep the k highest logits (0 or -1: all; stored as 0); 1 is greedy.
    top_p: keep the smallest set of highest-probability tokens whose mass reaches top_p (1: all).
    min_p: drop tokens whose probability is below min_p times the top token's (0: none).
    typical_p: keep the locally typical set of that mass (1: off; onnx_chunk/cutoffs.py).
    repetition_penalty: on the tokens already seen (prompt and generated), divide positive
        logits and multiply negative ones by it (1: off; any finite number > 0, a result past
        +-1e300 is held there); applied in greedy choice too.
    presence_penalty: subtracted from the logit of every token generated so far, in [-2, 2]
        (OpenAI's; the prompt does not count).
    frequency_penalty: subtracted once per time a token was generated so far, in [-2, 2].
    logit_bias: {token id: bias} added to the logits, each bias clamped to [-100, 100] (a
        mapping is stored as sorted (id, bias) pairs).
    allowed_token_ids: only these ids may be chosen (None: all; vLLM's whitelist).
    bad_words_ids: token sequences never generated whole: the last id of one is banned where
        the tokens generated so far end with the rest of it (a one-id sequence: always; vLLM's
        `bad_words`, encoded).
    min_tokens: no id of `held_token_ids` (the request's EOS and stop token ids) is chosen
        before this many new tokens.
    held_token_ids: the ids `min_tokens` holds back; required when min_tokens > 0.
    constraint: a grammar the output follows (structured output); None: free text.
    seed: the random generator's seed: an integer in [-2^63, 2^64), a negative one taken as
        its 64-bit two's complement (stored so); None or -1: fresh entropy, not reproducible.
    logprobs: give each chosen token's log-probability and the `logprobs` most likely tokens'
        (0: the chosen token's only; None: none). The log-probabilities are those of the
        distribution the token was chosen from (vLLM's "processed" mode): the log-softmax of
        the logits after every processor above; for a draw also divided by the temperature and
        cut by top-k, top-p, min-p and typical-p (a token they cut has -inf); for a greedy
        choice without temperature or cut (the argmax is the same).
    prompt_logprobs: give every prompt token's log-probability under the raw logits of the
        position before it, its rank there, and the `prompt_logprobs` most likely tokens'
        (None: none; the first prompt token has none). Asks the prefill for every row's logits.
    cache_salt: the batch engine reuses a kept prompt prefix only between requests of the
        same salt (None: the shared one), as vLLM's `cache_salt`; it changes no choice.
    The grammar, the allowed and banned ids, min_tokens, the bias and the penalties apply in
    greedy choice too, in that order (vLLM's: vllm/v1/sample/sampler.py).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0
    held_token_ids: tuple[int, ...] = ()
    constraint: Constraint | None = None
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_k", "top_p", "min_p", "typical_p",
                     "repetition_penalty", "presence_penalty", "frequency_penalty",
                     "min_tokens"):
            check_number(name, getattr(self, name))
        object.__setattr__(self, "top_k", max(int(self.top_k), 0))
        if self.seed is not None:
            object.__setattr__(self, "seed", _seed(self.seed))
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))
        held = token_ids(self.held_token_ids, "held_token_ids")
        object.__setattr__(self, "held_token_ids", held)
        if self.allowed_token_ids is not None:
            allowed = token_ids(self.allowed_token_ids, "allowed_token_ids")
            if not allowed:
                raise ConfigError("allowed_token_ids must name at least one token id (None "
                                  "allows every token)")
            object.__setattr__(self, "allowed_token_ids", allowed)
        words = tuple(token_ids(word, "bad_words_ids") for word in self.bad_words_ids)
        if any(not word for word in words):
            raise ConfigError("bad_words_ids must be non-empty token sequences")
        object.__setattr__(self, "bad_words_ids", words)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not is_count(value):
                raise ConfigError(f"{name} must be None or an integer >= 0 (the most likely "
                                  f"tokens given beside the chosen one), got {value!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ConfigError(f"cache_salt must be None or a string, got {self.cache_salt!r}")
        if self.min_tokens and not held:
            raise ConfigError("min_tokens needs held_token_ids: the ids it keeps out until then "
                              "(the request's EOS and stop token ids)")

    def for_choice(self, index: int) -> Sampling:
        """The sampling of choice `index` of a request of several: seed + index (modulo
        2^64), the same otherwise."""
        if self.seed is None or not index:
            return self
        return replace(self, seed=(self.seed + index) % _SEEDS)

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as checked at construction: sorted (id, clamped bias) pairs."""
        return cast(tuple[tuple[int, float], ...], self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Whether the choice is the argmax (temperature under GREEDY_TEMPERATURE, 0 included,
        or top_k 1): no draw."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def processes(self) -> bool:
        """Whether anything changes the logits before the choice (penalties, bias, grammar,
        allowed or banned ids)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias)
                or self.min_tokens > 0 or self.constraint is not None
                or self.allowed_token_ids is not None or bool(self.bad_words_ids))

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


_NO_CHOICE = ("the logits hold no finite maximum ({top}) after the request's processors: the "
              "model's output is broken at this step (NaN or infinities), or the grammar, "
              "min_tokens and logit_bias together left no token; nothing can be chosen")

# The largest magnitude a penalized logit keeps (divided by the smallest temperature that
# draws, GREEDY_TEMPERATURE, it stays finite in float64).
_PENALIZED_LIMIT = 1e300
# Seeds are taken modulo this (NumPy's generator takes [0, 2^64)).
_SEEDS = 1 << 64


class Sampler:
    """One request's token choice under a `Sampling`: seeded, with a preallocated work buffer.

    The order of operations: the grammar's mask, the allowed ids, the banned words, min_tokens'
    hold, the logit bias, the repetition penalty on the tokens seen, the presence and
    frequency penalties on the tokens generated (vLLM's order), then transformers' warpers:
    temperature, top-k, top-p, min-p, typical-p, and a draw from what is left. Every token
    whose processed logit reaches the strictest of top-k, top-p and min-p stays (ties at a
    cut-off are kept together); typical-p narrows that set (onnx_chunk/cutoffs.py).
    """

    def __init__(self, sampling: Sampling, vocab_size: int) -> None:
        self.sampling = sampling
        self._rng = np.random.default_rng(sampling.seed)
        self._penalize = sampling.repetition_penalty != 1.0
        self._seen: set[int] = set()
        self._seen_ids = np.empty(0, dtype=np.int64)
        bias = sampling.bias_pairs
        outside = [token for token in (*(token for token, _ in bias), *sampling.held_token_ids,
                                       *(sampling.allowed_token_ids or ()),
                                       *(token for word in sampling.bad_words_ids
                                         for token in word))
                   if token >= vocab_size]
        if outside:
            raise ConfigError(f"token id {outside[0]} (in logit_bias, the held, allowed or "
                              f"banned ids) is outside the vocabulary [0, {vocab_size})")
        # The ids never allowed: outside allowed_token_ids, and one-id bad words.
        self._barred: np.ndarray | None = None
        if sampling.allowed_token_ids is not None:
            self._barred = np.ones(vocab_size, dtype=bool)
            self._barred[list(sampling.allowed_token_ids)] = False
        always = [word[0] for word in sampling.bad_words_ids if len(word) == 1]
        if always:
            if self._barred is None:
                self._barred = np.zeros(vocab_size, dtype=bool)
            self._barred[always] = True
        # Longer bad words: banned where the tokens generated end with the rest of them.
        self._words = [word for word in sampling.bad_words_ids if len(word) > 1]
        self._recent: list[int] = []
        self._memory = max((len(word) for word in self._words), default=1) - 1
        self._bias_ids = np.array([token for token, _ in bias], dtype=np.int64)
        self._bias = np.array([value for _, value in bias], dtype=np.float64)
        self._held = np.array(sampling.held_token_ids, dtype=np.int64)
        self._counting = sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0
        # How often each generated token came (for the presence and frequency penalties).
        self._counts: dict[int, int] = {}
        self._generated = 0
        self._matcher = None if sampling.constraint is None else sampling.constraint.matcher()
        # Row 0: the processed logits, then the weights; row 1: their sorted copy; row 2: the
        # top-p weights, then the mask of the tokens kept.
        self._work = (None if sampling.greedy and not sampling.processes
                      else np.empty((3, vocab_size), dtype=np.float64))
        self._mask: np.ndarray | None = (None if self._work is None
                                         else np.empty(vocab_size, dtype=bool))
        # With logprobs: the distribution the token is chosen from, and an exp scratch row.
        self._top = sampling.logprobs or 0
        self._dist = (None if sampling.logprobs is None
                      else np.empty((2, vocab_size), dtype=np.float64))
        self.last: TokenLogprobs | None = None
        """The logprobs of the latest token `choose` returned (None unless asked for)."""

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
        """The next token for a [vocab] logits row; it counts as seen and generated from now
        on (and the grammar moves past it).

        `draft`: a token proposed for this position (speculative decoding). A greedy choice
        ignores it (the argmax either is the draft or is not); a draw keeps it with its
        probability p(draft) and otherwise draws from p with the draft removed, so the token
        returned is distributed exactly as without a draft.
        """
        if self._work is None:
            token = int(np.argmax(logits))
            if self._dist is not None:
                self.last = logprobs_of(logits, token, self._top, self._dist[1])
            return token
        token = self._choose(self._processed(logits), draft)
        if self._dist is not None:
            self.last = logprobs_of(self._dist[0], token, self._top, self._dist[1])
        self.observe((token,))
        self._generated += 1
        if self._memory:
            self._recent = [*self._recent[1 - self._memory:], token] if self._memory > 1 \
                else [token]
        if self._counting:
            self._counts[token] = self._counts.get(token, 0) + 1
        if self._matcher is not None:
            self._matcher.advance(token)
        return token

    @property
    def unprocessed_greedy(self) -> bool:
        """Whether the choice is the raw argmax (greedy, no processor): `lead` then reads the
        row alone and changes no state."""
        return self._work is None

    def lead(self, logits: np.ndarray, best: int | None = None) -> float:
        """How far the best processed score of a [vocab] row leads the runner-up (every
        processor applied; before temperature). `best`: the row's argmax where the caller has
        it already (the token an unprocessed greedy `choose` returned for this row)."""
        scores = logits if self._work is None else self._processed(logits)
        if scores.size < 2:
            return float("inf")
        # Two passes over the row (the best, then the best of the rest) cost a fifth of a
        # partition; the drafter reads a lead at every decode step.
        if best is None or self._work is not None:
            best = int(np.argmax(scores))
        runner_up = max(scores[:best].max(initial=-np.inf),
                        scores[best + 1:].max(initial=-np.inf))
        return float(scores[best] - runner_up)

    def _work_row(self) -> np.ndarray:
        work = self._work
        assert work is not None  # choose() comes here only with it
        return work[0]

    def _processed(self, logits: np.ndarray) -> np.ndarray:
        """The logits after the grammar, min_tokens, the bias and the penalties (in the work
        buffer's row 0)."""
        sampling = self.sampling
        scores = self._work_row()
        np.copyto(scores, logits)
        if self._matcher is not None:
            self._matcher.restrict(scores)
        if self._barred is not None:
            np.copyto(scores, -math.inf, where=self._barred)
        for word in self._words:
            if len(self._recent) >= len(word) - 1 and \
                    self._recent[len(self._recent) - len(word) + 1:] == list(word[:-1]):
                scores[word[-1]] = -math.inf
        if self._generated < sampling.min_tokens:
            scores[self._held] = -math.inf
        if self._bias_ids.size:
            scores[self._bias_ids] += self._bias
        if self._penalize and self._seen_ids.size:
            seen = scores[self._seen_ids]
            penalty = sampling.repetition_penalty
            with np.errstate(over="ignore"):
                penalized = np.where(seen > 0, seen / penalty, seen * penalty)
            # Any penalty > 0 is taken (vLLM's rule): a logit it would carry past the float
            # range stays at +-_PENALIZED_LIMIT, where a temperature cannot overflow it.
            np.clip(penalized, -_PENALIZED_LIMIT, _PENALIZED_LIMIT, out=penalized,
                    where=np.isfinite(seen))
            scores[self._seen_ids] = penalized
        if self._counts:
            ids = np.fromiter(self._counts, dtype=np.int64, count=len(self._counts))
            counts = np.fromiter(self._counts.values(), dtype=np.float64,
                                 count=len(self._counts))
            scores[ids] -= sampling.frequency_penalty * counts + sampling.presence_penalty
        return scores

    def _choose(self, scores: np.ndarray, draft: int | None) -> int:
        sampling = self.sampling
        work, mask = self._work, self._mask
        assert work is not None and mask is not None  # choose() comes here only with them
        _, ascending, scratch = work
        if sampling.greedy:
            token = int(np.argmax(scores))
            if not math.isfinite(scores[token]):
                raise ValueError(_NO_CHOICE.format(top=scores[token]))
            if self._dist is not None:
                np.copyto(self._dist[0], scores)
            return token
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
            cutoff = top_p_cutoff(scores, cutoff, top, sampling.top_p, ascending, scratch,
                                   mask)
        if sampling.min_p > 0.0:
            cutoff = max(cutoff, top + math.log(sampling.min_p))
        if not math.isfinite(top):
            raise ValueError(_NO_CHOICE.format(top=top))
        np.greater_equal(scores, cutoff, out=mask)
        if sampling.typical_p < 1.0:
            keep_typical(scores, mask, sampling.typical_p)
            top = float(np.max(scores, where=mask, initial=-math.inf))
        if self._dist is not None:
            # The distribution drawn from: what the cut-offs kept (the draw reuses `scores`).
            self._dist[0].fill(-math.inf)
            np.copyto(self._dist[0], scores, where=mask)
        if np.count_nonzero(mask) > GATHERED:
            # Many tokens left: draw over the whole row in place (the dropped ones weigh 0).
            scores -= top
            np.exp(scores, out=scores)
            scores *= mask
            if draft is not None and self._keeps_draft(scores, draft):
                return draft
            np.cumsum(scores, out=scores)
            return int(np.searchsorted(scores, self._rng.random() * scores[-1], side="right"))
        # A few left: draw among them only, in id order (the same choice as the whole row).
        kept = np.flatnonzero(mask)
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


def _seed(value: object) -> int | None:
    """A seed as the generator takes it: [0, 2^64) (None for -1)."""
    low = SEED_RANGE[0]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not low <= value < _SEEDS:
        raise ConfigError(f"seed must be None or an integer in [{low}, {_SEEDS}) (-1: none), "
                          f"got {value!r}")
    return None if value == -1 else int(value) % _SEEDS


def _search_value(search: Mapping[str, Any], key: str, default: Any) -> Any:
    value = search.get(key, default)
    return default if value is None else value


# The default: argmax, as the runtime chose before sampling existed.
GREEDY = Sampling()
