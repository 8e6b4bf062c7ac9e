"""Sampling: validated options, genai defaults, greedy equivalence and the drawn distribution."""

from __future__ import annotations

import math
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest

from onnx_chunk.errors import ConfigError
from onnx_chunk.sampling import GREEDY, Sampler, Sampling

# Upper 0.1% points of the chi-square distribution (p = 1e-3), by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12,
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
    assert statistic < CHI2_999[int(kept.sum()) - 1], (counts, draws * expected)


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
    ({"temperature": -0.1}, r"temperature must be a number in \[0, 2\]"),
    ({"temperature": 2.5}, r"temperature must be a number in \[0, 2\]"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_k": -2}, "top_k must be an integer >= -1"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.5}, "min_p"),
    ({"typical_p": 0.0}, r"typical_p must be a number in \(0, 1\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number > 0"),
    ({"seed": -2 ** 63 - 1}, "seed must be None or an integer"),
    ({"seed": 2 ** 64}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"allowed_token_ids": ()}, "allowed_token_ids must name at least one"),
    ({"allowed_token_ids": (1, -1)}, "allowed_token_ids must be token ids"),
    ({"bad_words_ids": ((),)}, "bad_words_ids must be non-empty"),
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


def _greedy_run(sampling: Sampling, logits: np.ndarray, steps: int,
                prompt: tuple[int, ...] = ()) -> list[int]:
    sampler = Sampler(sampling, logits.size)
    sampler.observe(prompt)
    return [sampler.choose(logits) for _ in range(steps)]


ROW = np.array([2.0, 1.5, 0.0, -1.0], dtype=np.float32)


def test_frequency_penalty_counts_every_generated_occurrence():
    # 0 first; then 0 drops by 1 per use, so 0 and 1 alternate.
    assert _greedy_run(Sampling(frequency_penalty=1.0), ROW, 4) == [0, 1, 0, 1]


def test_presence_penalty_applies_once_per_generated_token():
    # 0 and 1 each lose 1 once they have come: 1.0 against 0.5, so 0 stays ahead.
    assert _greedy_run(Sampling(presence_penalty=1.0), ROW, 5) == [0, 1, 0, 0, 0]


def test_presence_and_frequency_penalties_ignore_the_prompt():
    assert _greedy_run(Sampling(presence_penalty=2.0, frequency_penalty=2.0), ROW, 1,
                       prompt=(0, 0, 0)) == [0]


def test_draws_follow_the_penalized_softmax():
    # Each sampler first generates token 2 three times (forced), then draws once from LOGITS:
    # token 2's logit is lowered by presence + 3 * frequency.
    draws = 8000
    forced = np.full(LOGITS.size, -50.0, dtype=np.float32)
    forced[2] = 50.0
    counts = np.zeros(LOGITS.size, dtype=np.int64)
    for seed in range(draws):
        sampler = Sampler(Sampling(temperature=1.0, presence_penalty=0.5,
                                   frequency_penalty=0.4, seed=seed), LOGITS.size)
        assert [sampler.choose(forced) for _ in range(3)] == [2, 2, 2]
        counts[sampler.choose(LOGITS)] += 1
    scores = LOGITS.astype(np.float64)
    scores[2] -= 0.5 + 3 * 0.4
    expected = np.exp(scores - scores.max())
    expected /= expected.sum()
    statistic = float(((counts - draws * expected) ** 2 / (draws * expected)).sum())
    assert statistic < CHI2_999[LOGITS.size - 1], (counts, draws * expected)


def test_logit_bias_adds_and_clamps():
    assert Sampling(logit_bias={3: 1000, 1: -7}).logit_bias == ((1, -7.0), (3, 100.0))
    assert _greedy_run(Sampling(logit_bias={3: 5.0}), ROW, 2) == [3, 3]
    assert _greedy_run(Sampling(logit_bias={0: -100}), ROW, 1) == [1]


@pytest.mark.parametrize("bad", [{-1: 1.0}, {"3": 1.0}, {1: "x"}, {1: math.nan}, [(1, 1.0),
                                                                                   (1, 2.0)]])
def test_logit_bias_refuses_what_is_not_ids_to_numbers(bad):
    with pytest.raises(ConfigError, match="logit_bias"):
        Sampling(logit_bias=bad)


def test_logit_bias_outside_the_vocabulary_is_refused_by_the_sampler():
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        Sampler(Sampling(logit_bias={ROW.size: 1.0}), ROW.size)


def test_min_tokens_holds_the_end_ids_back():
    sampling = Sampling(min_tokens=3, held_token_ids=(0,))
    assert _greedy_run(sampling, ROW, 5) == [1, 1, 1, 0, 0]


def test_min_tokens_needs_the_ids_it_holds():
    with pytest.raises(ConfigError, match="held_token_ids"):
        Sampling(min_tokens=2)


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [-2.5, 2.01, True, math.inf])
def test_penalties_are_checked(name, value):
    with pytest.raises(ConfigError, match=name):
        Sampling(**{name: value})


class _OnlyEven:
    """A constraint allowing even ids only, recording what it was advanced by."""

    def __init__(self) -> None:
        self.advanced: list[int] = []

    def matcher(self):
        return self

    def restrict(self, scores: np.ndarray) -> None:
        scores[1::2] = -np.inf

    def advance(self, token: int) -> None:
        self.advanced.append(token)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.5, seed=3)], ids=repr)
def test_a_constraint_masks_every_choice_and_sees_every_token(sampling):
    logits = np.random.default_rng(0).normal(size=64).astype(np.float32)
    constraint = _OnlyEven()
    sampler = Sampler(replace(sampling, constraint=constraint), logits.size)
    chosen = [sampler.choose(logits) for _ in range(200)]
    assert all(token % 2 == 0 for token in chosen)
    assert constraint.advanced == chosen


def test_nothing_left_to_choose_is_an_error_not_token_zero():
    sampling = Sampling(logit_bias={0: -100}, min_tokens=1, held_token_ids=(1, 2, 3))
    row = np.array([0.0, 0.0, 0.0, 0.0], dtype=np.float32)
    row[0] = -np.inf
    with pytest.raises(ValueError, match="no finite maximum"):
        Sampler(sampling, 4).choose(row)


# Logprobs: those of the distribution each token is chosen from.

def _log_softmax(row: np.ndarray) -> np.ndarray:
    row = np.asarray(row, dtype=np.float64)
    return row - row.max() - np.log(np.exp(row - row.max()).sum())


def test_greedy_logprobs_are_the_log_softmax_of_the_logits():
    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)
    sampler = Sampler(Sampling(logprobs=4), 50)
    token = sampler.choose(logits)
    expected = _log_softmax(logits)
    assert sampler.last.token == token == int(np.argmax(logits))
    assert sampler.last.logprob == pytest.approx(expected[token])
    assert [index for index, _ in sampler.last.top] == list(np.argsort(-expected)[:4])
    assert [value for _, value in sampler.last.top] == pytest.approx(np.sort(expected)[::-1][:4])


def test_processed_logprobs_follow_bias_and_penalties():
    logits = np.zeros(10, dtype=np.float32)
    sampler = Sampler(Sampling(logit_bias={3: 2.0}, logprobs=0), 10)
    assert sampler.choose(logits) == 3
    assert sampler.last.logprob == pytest.approx(_log_softmax(np.eye(10)[3] * 2.0)[3])
    assert sampler.last.top == ()


def test_drawn_logprobs_are_those_of_the_cut_and_scaled_distribution():
    logits = np.random.default_rng(1).normal(size=30)
    sampler = Sampler(Sampling(temperature=0.5, top_k=3, seed=4, logprobs=5), 30)
    token = sampler.choose(logits)
    scaled = logits / 0.5
    kept = np.argsort(-scaled)[:3]
    expected = scaled[kept] - scaled[kept].max() - np.log(
        np.exp(scaled[kept] - scaled[kept].max()).sum())
    assert token in kept
    assert sampler.last.logprob == pytest.approx(expected[list(kept).index(token)])
    assert [value for _, value in sampler.last.top[:3]] == pytest.approx(expected)
    assert [value for _, value in sampler.last.top[3:]] == [-np.inf, -np.inf]


def test_a_sampler_without_logprobs_keeps_none():
    sampler = Sampler(Sampling(), 10)
    sampler.choose(np.arange(10.0))
    assert sampler.last is None


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprob_counts_are_checked(field):
    with pytest.raises(ConfigError, match=field):
        Sampling(**{field: -1})


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
    assert statistic < CHI2_999[int(kept.sum()) - 1], (counts, draws * expected)


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
    assert statistic < CHI2_999[3], (head, want)


def test_a_greedy_choice_ignores_the_draft():
    sampler = Sampler(GREEDY, LOGITS.size)
    assert sampler.choose(LOGITS, draft=3) == 0
    penalized = Sampler(Sampling(repetition_penalty=5.0), LOGITS.size)
    penalized.observe((0,))
    assert penalized.choose(LOGITS, draft=0) == 10


@pytest.mark.parametrize("temperature", [1e-310, 1e-8, 9.9e-6])
def test_a_vanishing_temperature_chooses_greedily(temperature):
    logits = np.array([0.5, 3.0, -1.0, 2.9], dtype=np.float32)
    sampling = Sampling(temperature=temperature, seed=1)
    assert sampling.greedy
    assert [Sampler(sampling, logits.size).choose(logits) for _ in range(3)] == [1, 1, 1]


def test_generate_with_a_vanishing_temperature_is_greedy_not_a_crash(capsys):
    import json

    from onnx_chunk.cli import main
    from tests.exports.corpus import ROOT

    base = ["generate", str(ROOT / "genai-qwen3-fp32"), "--prompt", "Paris is",
            "--max-new-tokens", "4", "--json", "--provider", "cpu"]
    texts = []
    for temperature in ("0", "1e-310"):
        assert main([*base, "--temperature", temperature]) == 0
        texts.append(json.loads(capsys.readouterr().out)["tokens"])
    assert texts[0] == texts[1]
