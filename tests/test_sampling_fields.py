"""vLLM's sampling fields in the one Sampler: the allowed and banned ids, typical-p, the one
numeric-range rule (with its extremes), seeds, and the rank of a prompt token's logprob."""

from __future__ import annotations

import math

import numpy as np
import pytest

from onnx_chunk.errors import ConfigError
from onnx_chunk.sampling import RANGES, Sampler, Sampling, prompt_logprobs_of
from tests.test_sampling import CHI2_999, LOGITS


def _typical(logits: np.ndarray, mass: float, temperature: float = 1.0) -> np.ndarray:
    """transformers' TypicalLogitsWarper, token by token: the kept tokens' distribution."""
    scores = [float(value) / temperature for value in logits]
    top = max(scores)
    total = sum(math.exp(value - top) for value in scores)
    logp = [value - top - math.log(total) for value in scores]
    p = [math.exp(value) for value in logp]
    entropy = -sum(a * b for a, b in zip(p, logp))
    shifted = [abs(-value - entropy) for value in logp]
    order = sorted(range(len(scores)), key=lambda index: shifted[index])
    cumulative, last = 0.0, len(order) - 1
    for position, index in enumerate(order):
        cumulative += p[index]
        if cumulative >= mass:
            last = position
            break
    keep = [shifted[index] <= shifted[order[last]] for index in range(len(scores))]
    weights = np.array([math.exp(scores[i] - top) if keep[i] else 0.0
                        for i in range(len(scores))])
    return weights / weights.sum()


@pytest.mark.parametrize("mass, temperature", [(0.3, 1.0), (0.6, 0.8), (0.95, 1.2)])
def test_draws_follow_the_locally_typical_set(mass, temperature):
    draws = 20000
    sampler = Sampler(Sampling(temperature=temperature, typical_p=mass, seed=21), LOGITS.size)
    counts = np.bincount([sampler.choose(LOGITS) for _ in range(draws)], minlength=LOGITS.size)
    expected = _typical(LOGITS, mass, temperature)
    kept = expected > 0
    assert 0 < int(kept.sum()) < LOGITS.size  # the set drops some tokens
    assert counts[~kept].sum() == 0, "a token outside the typical set was drawn"
    statistic = float((((counts - draws * expected) ** 2)[kept]
                       / (draws * expected[kept])).sum())
    assert statistic < CHI2_999[max(int(kept.sum()) - 1, 1)], (counts, draws * expected)


def test_typical_p_can_drop_the_most_likely_token():
    # One token ahead of a hundred alike: the entropy is high, the top token's surprise far
    # below it, the others' close to it.
    row = np.array([3.0] + [0.0] * 100)
    expected = _typical(row, 0.2)
    assert expected[0] == 0.0
    sampler = Sampler(Sampling(temperature=1.0, typical_p=0.2, seed=2), row.size)
    assert 0 not in {sampler.choose(row) for _ in range(500)}


def test_allowed_token_ids_are_the_only_choices_greedy_or_drawn():
    row = np.arange(20.0)
    greedy = Sampler(Sampling(allowed_token_ids=(3, 7)), 20)
    assert greedy.choose(row) == 7
    drawn = Sampler(Sampling(temperature=1.0, allowed_token_ids=(3, 7, 11), seed=1), 20)
    assert {drawn.choose(np.zeros(20)) for _ in range(300)} == {3, 7, 11}


def test_a_one_token_bad_word_is_always_banned_a_longer_one_after_its_prefix():
    row = np.zeros(6)
    row[4] = 5.0  # the argmax, unless banned
    banned_always = Sampler(Sampling(bad_words_ids=((4,),)), 6)
    assert banned_always.choose(row) != 4
    sequence = Sampler(Sampling(bad_words_ids=((1, 2, 4),), logprobs=0), 6)
    forced = np.full(6, -10.0)
    for token in (1, 2):  # the generated tokens end with the word's prefix ...
        forced[:] = -10.0
        forced[token] = 10.0
        assert sequence.choose(forced) == token
    assert sequence.choose(row) != 4  # ... so its last token is banned
    assert sequence.last.logprob > -math.inf
    assert sequence.choose(row) == 4  # the prefix is gone: allowed again


def test_bad_words_look_at_generated_tokens_not_the_prompt():
    sampler = Sampler(Sampling(bad_words_ids=((1, 4),), repetition_penalty=1.0), 6)
    sampler.observe([1])  # the prompt
    row = np.zeros(6)
    row[4] = 5.0
    assert sampler.choose(row) == 4


@pytest.mark.parametrize("penalty", [1e-320, 1e-300, 1e300, float(np.finfo(np.float64).max)])
def test_any_finite_positive_repetition_penalty_keeps_the_choice_defined(penalty):
    row = np.random.default_rng(3).normal(size=50) * 10
    for sampling in (Sampling(repetition_penalty=penalty, logprobs=3),
                     Sampling(repetition_penalty=penalty, temperature=1e-4, seed=1,
                              logprobs=3)):
        sampler = Sampler(sampling, 50)
        sampler.observe(range(0, 50, 2))
        token = sampler.choose(row)
        assert 0 <= token < 50 and math.isfinite(sampler.last.logprob)


def test_the_ranges_are_vllms():
    assert RANGES["temperature"].describe() == "a number in [0, 2] (0 is greedy)"
    assert RANGES["repetition_penalty"].describe() == "a finite number > 0 (1 is off)"
    assert RANGES["top_k"].holds(10 ** 18) and not RANGES["top_k"].holds(-2)
    assert Sampling(top_k=-1).top_k == 0


@pytest.mark.parametrize("seed, stored", [(-1, None), (5, 5), (-5, 2 ** 64 - 5),
                                          (2 ** 63, 2 ** 63)])
def test_seeds_are_64_bit_and_minus_one_is_none(seed, stored):
    assert Sampling(seed=seed).seed == stored


def test_choice_i_takes_seed_plus_i_modulo_2_to_the_64():
    assert Sampling(seed=7).for_choice(2).seed == 9
    assert Sampling(seed=-2).for_choice(1).seed == 2 ** 64 - 1
    assert Sampling(seed=2 ** 64 - 1).for_choice(1).seed == 0
    assert Sampling().for_choice(3).seed is None


def test_a_prompt_tokens_rank_counts_the_tokens_at_least_as_likely():
    rows = np.array([[0.0, 3.0, 1.0, 0.5], [2.0, 2.0, 2.0, -1.0]])
    first, second = prompt_logprobs_of(rows, np.array([2, 1]), top=2)
    assert first.rank == 2 and second.rank == 3  # ties count: vLLM's `>=`
    assert [token for token, _ in first.top] == [1, 2]


def test_ids_outside_the_vocabulary_are_refused_by_the_sampler():
    for sampling in (Sampling(allowed_token_ids=(3, 99)), Sampling(bad_words_ids=((2, 99),))):
        with pytest.raises(ConfigError, match="99 .*outside the vocabulary"):
            Sampler(sampling, 10)
