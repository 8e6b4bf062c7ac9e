"""Sampling: validated options, genai defaults, greedy equivalence and the drawn distribution."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from onnx_chunk.errors import ConfigError
from onnx_chunk.sampling import GREEDY, Sampler, Sampling

# Upper 0.1% points of the chi-square distribution (p = 1e-3), by degrees of freedom.
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12,
             9: 27.88, 10: 29.59, 11: 31.26}

LOGITS = np.array([2.0, 1.5, 1.2, 0.9, 0.5, 0.1, -0.3, -0.8, -1.5, -2.5, 1.9, 0.0],
                  dtype=np.float32)
SEEN = tuple(range(LOGITS.size))


def _expected(logits: np.ndarray, sampling: Sampling, seen: tuple[int, ...]) -> np.ndarray:
    """The distribution transformers' processors give, computed token by token."""
    scores = [float(value) for value in logits]
    for token in set(seen):
        value = scores[token]
        penalty = sampling.repetition_penalty
        scores[token] = value / penalty if value > 0 else value * penalty
    scores = [value / sampling.temperature for value in scores]
    keep = [True] * len(scores)
    order = sorted(range(len(scores)), key=lambda index: scores[index], reverse=True)
    if sampling.top_k:
        for index in order[sampling.top_k:]:
            keep[index] = False
    if sampling.top_p < 1.0:
        weights = [math.exp(scores[i]) if keep[i] else 0.0 for i in range(len(scores))]
        total = sum(weights)
        mass = 0.0
        for position, index in enumerate(order):
            if position > 0 and mass >= sampling.top_p:
                keep[index] = False
            mass += weights[index] / total
    if sampling.min_p > 0.0:
        weights = [math.exp(scores[i]) if keep[i] else 0.0 for i in range(len(scores))]
        for index, weight in enumerate(weights):
            if weight < sampling.min_p * max(weights):
                keep[index] = False
    weights = np.array([math.exp(scores[i]) if keep[i] else 0.0 for i in range(len(scores))])
    return weights / weights.sum()


@pytest.mark.parametrize("sampling", [
    Sampling(temperature=1.0, seed=11),
    Sampling(temperature=0.6, seed=12),
    Sampling(temperature=1.7, seed=13),
    Sampling(temperature=1.0, top_k=4, seed=14),
    Sampling(temperature=1.0, top_p=0.7, seed=15),
    Sampling(temperature=1.3, top_k=6, top_p=0.8, seed=16),
    Sampling(temperature=1.0, min_p=0.2, seed=17),
    Sampling(temperature=1.0, repetition_penalty=1.8, seed=18),
    Sampling(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05, repetition_penalty=1.3, seed=19),
], ids=repr)
def test_draws_follow_the_truncated_softmax(sampling):
    draws = 20000
    sampler = Sampler(sampling, LOGITS.size)
    # Every token counts as seen, so the draws do not change what the penalty applies to.
    sampler.observe(SEEN)
    counts = np.bincount([sampler.choose(LOGITS) for _ in range(draws)], minlength=LOGITS.size)
    expected = _expected(LOGITS, sampling, SEEN if sampling.repetition_penalty != 1 else ())
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token the filters drop was drawn"
    statistic = float((((counts - draws * expected) ** 2)[kept]
                       / (draws * expected[kept])).sum())
    assert statistic < _CHI2_999[int(kept.sum()) - 1], (counts, draws * expected)


def test_the_filters_do_drop_tokens():
    # The cases above are not vacuous: each filter removes some of the twelve tokens.
    for sampling in (Sampling(temperature=1, top_k=4), Sampling(temperature=1, top_p=0.7),
                     Sampling(temperature=1, min_p=0.2)):
        assert 0 < int((_expected(LOGITS, sampling, ()) > 0).sum()) < LOGITS.size


def test_seeded_runs_repeat_and_seeds_differ():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(50, 300)).astype(np.float32)

    def run(seed):
        sampler = Sampler(Sampling(temperature=1.0, top_p=0.95, seed=seed), 300)
        return [sampler.choose(row) for row in rows]

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=0.9, top_k=1, seed=3),
                                      Sampling(temperature=0.0, top_p=0.5, seed=4)], ids=repr)
def test_top_k_1_and_temperature_0_are_argmax_with_the_lowest_id_on_ties(sampling):
    rng = np.random.default_rng(1)
    sampler = Sampler(sampling, 64)
    for _ in range(100):
        row = rng.integers(-3, 3, size=64).astype(np.float32)  # many ties
        assert sampler.choose(row) == int(np.argmax(row))


def test_repetition_penalty_applies_in_greedy_choice():
    sampler = Sampler(Sampling(repetition_penalty=2.0), 3)
    sampler.observe([0])
    assert sampler.choose(np.array([3.0, 2.0, -1.0], dtype=np.float32)) == 1
    negative = Sampler(Sampling(repetition_penalty=2.0), 3)
    negative.observe([1])
    assert negative.choose(np.array([-1.5, -1.0, -1.9], dtype=np.float32)) == 0


def test_no_vocab_sized_allocation_per_token():
    vocab = 200_000
    sampler = Sampler(Sampling(temperature=0.8, top_k=40, top_p=0.9, min_p=0.01,
                               repetition_penalty=1.1, seed=0), vocab)
    row = np.random.default_rng(2).normal(size=vocab).astype(np.float32)
    sampler.choose(row)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for _ in range(40):
            sampler.choose(row)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    # A float32 copy of the row would take 800 kB, a bool mask 200 kB; what remains is
    # NumPy's fixed-size ufunc buffers and the seen-token ids.
    assert peak < vocab // 4, peak


@pytest.mark.parametrize("options, message", [
    ({"temperature": -0.1}, "temperature must be a number >= 0"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a number > 0"),
    ({"seed": -1}, "seed must be a non-negative integer"),
    ({"seed": 1.5}, "seed"),
])
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(ConfigError, match=message):
        Sampling(**options)


def test_genai_search_defaults_and_overrides():
    search = {"do_sample": False, "temperature": 0.7, "top_k": 50, "top_p": 0.9,
              "repetition_penalty": 1.1, "random_seed": 5}
    assert Sampling.from_search(search) == Sampling(repetition_penalty=1.1)
    sampled = Sampling.from_search({**search, "do_sample": True})
    assert sampled == Sampling(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1,
                               seed=5)
    assert Sampling.from_search({"do_sample": True, "random_seed": -1}).seed is None
    assert Sampling.from_search({}) == GREEDY
    overridden = Sampling.from_search({**search, "do_sample": True}, top_k=5, seed=None)
    assert overridden.top_k == 5 and overridden.seed == 5
    assert Sampling.from_search(search, temperature=0.5).temperature == 0.5
    with pytest.raises(ConfigError, match="unknown sampling option"):
        Sampling.from_search({}, topk=3)
    with pytest.raises(ConfigError, match="top_p"):
        Sampling.from_search({"do_sample": True, "top_p": 0})


def test_sampling_is_exported_from_the_package():
    import onnx_chunk

    assert onnx_chunk.Sampling is Sampling
    assert "Sampling" in onnx_chunk.__all__


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_logits_without_a_finite_maximum_are_a_clear_error(bad):
    row = np.zeros(64, dtype=np.float32)
    row[5] = bad
    with pytest.raises(ValueError, match="no finite maximum"):
        Sampler(Sampling(temperature=0.7, seed=0), 64).choose(row)


@pytest.mark.parametrize("draft", [0, 4, 9], ids=lambda draft: f"draft{draft}")
@pytest.mark.parametrize("sampling", [
    Sampling(temperature=1.0, seed=31),
    Sampling(temperature=1.0, top_k=4, seed=32),
    Sampling(temperature=0.8, top_p=0.8, repetition_penalty=1.3, seed=33),
], ids=repr)
def test_a_drafted_token_leaves_the_distribution_exact(sampling, draft):
    """The rejection rule for a deterministic draft (keep it with p(draft), else draw from p
    without it): the tokens are distributed as without a draft, whichever token is drafted
    (the most likely one, a middling one, one the filters drop)."""
    draws = 20000
    sampler = Sampler(sampling, LOGITS.size)
    sampler.observe(SEEN)
    counts = np.bincount([sampler.choose(LOGITS, draft=draft) for _ in range(draws)],
                         minlength=LOGITS.size)
    expected = _expected(LOGITS, sampling, SEEN if sampling.repetition_penalty != 1 else ())
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token the filters drop was drawn"
    statistic = float((((counts - draws * expected) ** 2)[kept]
                       / (draws * expected[kept])).sum())
    assert statistic < _CHI2_999[int(kept.sum()) - 1], (counts, draws * expected)


def test_a_draft_over_a_large_vocabulary_is_kept_with_its_probability():
    """The whole-row draw (more tokens kept than the gathered path takes): a draft of
    probability p is returned p of the time, and the rest follow p without it."""
    vocab = 6000
    logits = np.zeros(vocab, dtype=np.float32)
    logits[:3] = (8.0, 7.0, 6.5)
    expected = np.exp(logits - logits.max())
    expected /= expected.sum()
    sampler = Sampler(Sampling(temperature=1.0, seed=5), vocab)
    draws = 20000
    tokens = np.array([sampler.choose(logits, draft=1) for _ in range(draws)])
    head = np.array([np.count_nonzero(tokens == index) for index in range(3)]
                    + [np.count_nonzero(tokens >= 3)])
    want = np.append(expected[:3], expected[3:].sum()) * draws
    statistic = float(((head - want) ** 2 / want).sum())
    assert statistic < _CHI2_999[3], (head, want)


def test_a_greedy_choice_ignores_the_draft():
    sampler = Sampler(GREEDY, LOGITS.size)
    assert sampler.choose(LOGITS, draft=3) == 0
    penalized = Sampler(Sampling(repetition_penalty=5.0), LOGITS.size)
    penalized.observe((0,))
    assert penalized.choose(LOGITS, draft=0) == 10
