"""Prompt-lookup speculative decoding: the drafting function's properties, the back-off, greedy
output identical to plain decoding (a lone sequence and the batch engine, reference decoders
and real exports), sampled output exact in distribution, the refusals and the counters."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_chunk.errors import ConfigError
from onnx_chunk.runtime import facade, load
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for
from onnx_chunk.runtime.engine import speculation
from onnx_chunk.runtime.engine.speculation import (
    DRAFT_TOKENS,
    MAX_BACKOFF,
    DraftBackoff,
    Drafter,
    Speculation,
    accepted,
    draft_length,
    probe_may_pay,
    propose_draft,
    verify,
)
from onnx_chunk.sampling import GREEDY, Sampler, Sampling
from tests.exports.corpus import builder_gqa_fixtures

SPEC = "prompt-lookup"
W = 16


def _occurs_before(history: list[int], gram: list[int]) -> list[int]:
    """Starts of `gram` in `history` that end before its last token."""
    n = len(gram)
    return [start for start in range(len(history) - n) if history[start:start + n] == gram]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=60), st.integers(1, 6))
def test_a_draft_continues_the_latest_occurrence_of_the_longest_recurring_ngram(history, k):
    draft = propose_draft(np.array(history, dtype=np.int64), k).tolist()
    assert len(draft) <= k
    for n in (3, 2, 1):
        if n >= len(history):
            continue
        starts = _occurs_before(history, history[len(history) - n:])
        if starts:
            start = starts[-1]
            assert draft == history[start + n:start + n + k]
            return
    assert draft == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=8, unique=True),
       st.integers(2, 6), st.integers(1, 6))
def test_a_periodic_text_is_drafted_exactly(period, repeats, k):
    """Text that repeats itself is what prompt lookup predicts: the draft is its continuation."""
    text = period * repeats
    cut = len(period) + 1
    history = np.array(text[:cut], dtype=np.int64)
    draft = propose_draft(history, k).tolist()
    continuation = (period * (repeats + 2))[cut:cut + k]
    assert draft == continuation[:min(k, len(period))]


def test_the_backoff_doubles_after_each_failed_verification_and_resets_on_acceptance():
    backoff = DraftBackoff()
    waits = []
    for _ in range(8):
        assert backoff.ready()
        backoff.verified(0)
        wait = 0
        while not backoff.ready():
            wait += 1
        waits.append(wait)
    assert waits == [1, 2, 4, 8, 16, 32, MAX_BACKOFF, MAX_BACKOFF]
    backoff.verified(2)
    assert backoff.ready()
    backoff.verified(0)
    assert not backoff.ready() and backoff.ready()


def test_a_greedy_row_closer_than_the_margin_ends_the_verification_without_a_token():
    """Rule 3: a one-row forward may score differently from a multi-row one, so a greedy row
    whose best score leads by less than the margin is left to a plain decode step."""
    logits = np.zeros((4, 6), dtype=np.float32)
    logits[0, 2] = 1.0            # drafted 2, a clear lead: kept
    logits[1, [3, 4]] = 1.0, 0.9  # drafted 3, led by 0.1 only: not trusted
    logits[2, 0] = 1.0            # drafted 5, 0 leads clearly: the correction
    draft = np.array([2, 3, 5])
    assert verify(Sampler(GREEDY, 6), logits, draft, margin=0.25).tokens == [2]
    assert verify(Sampler(GREEDY, 6), logits, draft, margin=0.05).tokens == [2, 3, 0]
    assert accepted([2, 3, 0], draft) == 2
    logits[0, 2] = 0.1
    assert verify(Sampler(GREEDY, 6), logits, draft, margin=0.25).tokens == []
    # A draw is never held back: its distribution is the same either way.
    drawn = verify(Sampler(Sampling(temperature=1.0, seed=0), 6), logits, draft, 0.25)
    assert len(drawn.tokens) >= 1


def test_the_draft_length_gives_most_tokens_per_cost():
    assert draft_length(0.0) == 0 and draft_length(0.15) == 0
    assert draft_length(0.5) == 1
    lengths = [draft_length(rate) for rate in (0.3, 0.5, 0.7, 0.8, 0.9, 0.97)]
    assert lengths == sorted(lengths) and lengths[-1] == DRAFT_TOKENS
    assert draft_length(0.99, most=3) == 3


def test_the_draft_length_weighs_how_often_a_first_row_is_trusted():
    """A verification whose first row leads by less than the margin gives no token: with the
    confidence rate of a random-weight INT4 export (23% of steps lead by 0.25) no draft pays,
    not even a probe; a sure decoder drafts as before."""
    assert draft_length(0.9, confidence=0.23) == 0 and not probe_may_pay(0.23)
    assert draft_length(0.9, confidence=1.0) == draft_length(0.9) > 1 and probe_may_pay(0.9)
    assert draft_length(0.9, confidence=0.8) < draft_length(0.9)


def test_a_decoder_rarely_sure_of_its_next_token_stops_drafting_and_resumes_when_sure():
    drafter = Drafter(np.array([1, 2, 3, 4] * 6), Speculation(margin=0.25))
    greedy = Sampler(GREEDY, 6)
    close = np.array([0.0, 0.1, 1.0, 0.9, 0.0, 0.0], dtype=np.float32)   # leads by 0.1
    sure = np.array([0.0, 0.0, 2.0, 0.0, 0.0, 0.0], dtype=np.float32)    # leads by 2
    assert len(drafter.draft(24, 100)) == 1
    for _ in range(40):
        drafter.observe(greedy, close, 2)
    assert drafter.confidence < 0.2
    # The n-gram still recurs, but neither a draft nor a probe is tried however long it waits.
    assert not any(len(drafter.draft(24, 100)) for _ in range(200))
    for _ in range(40):
        drafter.observe(greedy, sure, 2)
    assert drafter.confidence > 0.8
    assert any(len(drafter.draft(24, 100)) for _ in range(40))
    # Sampled requests and float decoders (a margin of 0) are not counted.
    for sampler, rule in ((Sampler(Sampling(temperature=1.0, seed=0), 6),
                           Speculation(margin=0.25)), (greedy, Speculation(margin=0.0))):
        other = Drafter(np.array([1, 2, 3, 4] * 6), rule)
        for _ in range(40):
            other.observe(sampler, close, 2)
        assert other.confidence == 1.0


def test_the_lead_is_the_best_score_minus_the_runner_up():
    rng = np.random.default_rng(0)
    greedy = Sampler(GREEDY, 1000)
    for _ in range(20):
        row = rng.standard_normal(1000).astype(np.float32)
        top = np.sort(row)[-2:]
        assert greedy.lead(row) == pytest.approx(float(top[1] - top[0]))
    row[[3, 700]] = row.max() + 1.0   # a tie at the top leads by nothing
    assert greedy.lead(row) == 0.0
    assert greedy.lead(np.array([0.5], dtype=np.float32)) == float("inf")


def test_drafts_lengthen_while_kept_and_back_off_when_rejected():
    drafter = Drafter(np.array([1, 2, 3, 4] * 6), Speculation())
    logits = np.zeros((DRAFT_TOKENS + 1, 6), dtype=np.float32)
    lengths = []
    for _ in range(6):
        draft = drafter.draft(24, 100)
        lengths.append(len(draft))
        rows = logits[:len(draft) + 1].copy()
        rows[np.arange(len(draft)), draft] = 1.0
        rows[len(draft), 0] = 1.0
        assert drafter.verified(Sampler(GREEDY, 6), rows, draft).tokens == [*draft, 0]
    # (the history's period, 4, bounds what a lookup can draft here)
    assert lengths[0] == 1 and lengths == sorted(lengths) and lengths[-1] == 4
    assert draft_length(drafter.acceptance) > 4
    waits = []
    for _ in range(16):
        wait = 0
        while not len(draft := drafter.draft(24, 100)):
            wait += 1
        waits.append(wait)
        rows = logits[:len(draft) + 1].copy()
        rows[:, 5] = 1.0
        assert drafter.verified(Sampler(GREEDY, 6), rows, draft).tokens == [5]
    # Rejections: the drafts shrink to a one-token probe, then wait ever longer between probes.
    assert waits[0] == 0 and waits == sorted(waits) and waits[-1] > 2
    assert draft_length(drafter.acceptance) == 0
    assert len(drafter.draft(24, 0)) == 0  # nothing left to draft for


def _prompts(vocab: int, lengths=(5, 23, 1, 40), seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for length in lengths]


def _alone(runtime, prompts, new_tokens, **options) -> list[list[int]]:
    results = []
    for prompt in prompts:
        with runtime.open_sequence() as sequence:
            results.append(sequence.generate(prompt, new_tokens, [], **options))
    return results


class _Oracle:
    """A drafter that knows the plain continuation of each prompt and drafts it, with one
    token wrong in every other draft: drafts are kept, cut short and rejected outright, so
    the verification and the rewind run whatever the model would repeat."""

    def __init__(self, prompts, continuations, k=4):
        self.texts = [np.array(prompt + tokens) for prompt, tokens in zip(prompts, continuations)]
        self.calls = 0
        self.k = k

    def __call__(self, history, k=speculation.DRAFT_TOKENS, **_):
        self.calls += 1
        for text in self.texts:
            if len(history) < len(text) and np.array_equal(text[:len(history)], history):
                draft = text[len(history):len(history) + k].copy()
                if self.calls % 2 and len(draft):
                    wrong = self.calls % len(draft)
                    draft[wrong] = (draft[wrong] + 1) % 7
                return draft
        return np.zeros(min(k, 3), dtype=np.int64)


@pytest.mark.parametrize("variant", ["base", "int4", "position_ids", "inputs_embeds"])
def test_greedy_output_equals_plain_decoding_with_drafts_kept_and_rejected(
        reference_model, monkeypatch, variant):
    path = reference_model(variant)
    plain = load(path, provider="cpu", capacity=160, chunk_size=W)
    prompts = _prompts(plain.stats.vocab_size)
    expected = _alone(plain, prompts, 40)
    oracle = _Oracle(prompts, expected)
    monkeypatch.setattr(speculation, "propose_draft", oracle)
    with load(path, provider="cpu", capacity=160, chunk_size=W, speculative=SPEC) as spec:
        results, kept, drafted = [], 0, 0
        for prompt in prompts:
            with spec.open_sequence() as sequence:
                results.append(sequence.generate(prompt, 40, []))
                stats = sequence.stats
                # The KV holds the prompt and every token but the last, as plain decoding's.
                assert stats.length == len(prompt) + 39
                kept += stats.accepted_tokens
                drafted += stats.draft_tokens
        assert results == expected
        assert 0 < kept < drafted
        assert spec.generate_many(prompts, 40, eos_token_id=[]) == expected
        engine = spec.stats.engine
        assert 0 < engine.accepted_tokens < engine.draft_tokens and engine.verify_forwards


def test_greedy_parity_on_the_device_path(reference_model, monkeypatch):
    """The CPU marked not host-visible, as CUDA looks: the capacity mask, per-width variants
    with padding, row-selecting sessions (a verification binds every row's logits)."""
    device = dataclasses.replace(device_for("cpu"), host_visible=False,
                                 mask_policy=MaskPolicy.CAPACITY, specialize=True)
    monkeypatch.setattr(facade, "resolve_device", lambda *args: device)
    path = reference_model("base")
    plain = load(path, provider="cpu", capacity=160, chunk_size=W)
    prompts = _prompts(plain.stats.vocab_size)
    expected = _alone(plain, prompts, 30)
    monkeypatch.setattr(speculation, "propose_draft", _Oracle(prompts, expected))
    with load(path, provider="cpu", capacity=160, chunk_size=W, max_batch=2,
              speculative=SPEC) as spec:
        assert spec.debug.options.select_rows
        assert _alone(spec, prompts, 30) == expected
        assert spec.generate_many(prompts, 30, eos_token_id=[]) == expected
        assert spec.stats.engine.accepted_tokens > 0


def test_the_engine_mixes_rows_with_drafts_and_rows_without(reference_model, monkeypatch):
    """Drafts for some requests only: the others decode in the batched forward meanwhile."""
    path = reference_model("base")
    plain = load(path, provider="cpu", capacity=160, chunk_size=W)
    prompts = _prompts(plain.stats.vocab_size, (5, 23, 1, 40, 17, 9), seed=3)
    expected = _alone(plain, prompts, 30)
    oracle = _Oracle(prompts[::2], expected[::2])
    monkeypatch.setattr(speculation, "propose_draft",
                        lambda history, k=4, **_: oracle(history, k)
                        if any(len(history) < len(text) and np.array_equal(text[:len(history)],
                                                                          history)
                               for text in oracle.texts) else np.empty(0, dtype=np.int64))
    with load(path, provider="cpu", capacity=160, chunk_size=W, max_batch=3,
              speculative=SPEC) as spec:
        assert spec.generate_many(prompts, 30, eos_token_id=[]) == expected
        engine = spec.stats.engine
        assert engine.verify_forwards and engine.accepted_tokens
        assert engine.rows_per_decode_step > 1


def test_a_stop_token_inside_an_accepted_draft_ends_the_generation_there(reference_model,
                                                                         monkeypatch):
    path = reference_model("base")
    plain = load(path, provider="cpu", capacity=160, chunk_size=W)
    prompt = _prompts(plain.stats.vocab_size, (12,))[0]
    tokens = _alone(plain, [prompt], 30)[0]
    stop = tokens[9]
    expected = tokens[:tokens.index(stop) + 1]
    monkeypatch.setattr(speculation, "propose_draft", lambda history, k=4, **_: np.array(
        (prompt + tokens)[len(history):len(history) + k]))
    with load(path, provider="cpu", capacity=160, chunk_size=W, speculative=SPEC,
              max_batch=2) as spec:
        with spec.open_sequence() as sequence:
            assert sequence.generate(prompt, 30, stop) == expected
            assert sequence.length == len(prompt) + len(expected) - 1
        request = spec.submit(prompt, 30, eos_token_id=stop)
        assert request.result() == expected and request.finish_reason == "stop"
        request = spec.submit(prompt, 7, eos_token_id=[])
        assert request.result() == tokens[:7] and request.finish_reason == "length"


@pytest.mark.parametrize("fixture", [fixture for fixture in builder_gqa_fixtures()
                                     if fixture.model_type != "lfm2"], ids=str)
def test_greedy_output_equals_plain_decoding_on_the_real_exports(fixture):
    """Real prompt-lookup drafts (no oracle) on every builder export that allows them: llama,
    qwen3, phi3, gemma2 (a window-sized cache: drafts only where the rewind is exact); fp32
    and INT4; a lone sequence and the engine.

    Each is compared with plain decoding at its own slot count: a 2-slot engine decodes two
    rows a step, and on an INT4 export MatMulNBits may pick another kernel for two rows than
    for one, so a near-tie can fall the other way between a lone sequence and the engine
    without any draft (it does for qwen3 and phi3 on an AMD EPYC; docs/validate.md)."""
    with load(fixture.folder, provider="cpu", chunk_size=W, max_batch=2) as plain:
        prompts = _prompts(plain.stats.vocab_size, (5, 64, 130), seed=1)
        alone = _alone(plain, prompts, 120)
        engine = plain.generate_many(prompts, 120, eos_token_id=[])
    with load(fixture.folder, provider="cpu", chunk_size=W, max_batch=2,
              speculative=SPEC) as spec:
        assert _alone(spec, prompts, 120) == alone
        assert spec.generate_many(prompts, 120, eos_token_id=[]) == engine
        assert spec.stats.engine.draft_tokens > 0


def test_recurrent_state_and_last_row_logits_are_refused(reference_model):
    with pytest.raises(ConfigError, match="recurrent state"):
        load(reference_model("conv_hybrid"), provider="cpu", speculative=SPEC)
    with pytest.raises(ConfigError, match="last row's logits"):
        load(reference_model("last_token_logits"), provider="cpu", speculative=SPEC)
    with pytest.raises(ConfigError, match="speculative must be one of prompt-lookup"):
        load(reference_model("base"), provider="cpu", speculative="medusa")


def test_sampled_output_is_exact_in_distribution(reference_model, monkeypatch):
    """Over many seeds, the third new token's distribution with drafts (the greedy
    continuation, often accepted) equals plain sampling's (chi-square, tiny top-k vocab)."""
    path = reference_model("base")
    plain = load(path, provider="cpu", capacity=64, chunk_size=W)
    prompt = _prompts(plain.stats.vocab_size, (6,))[0]
    greedy = _alone(plain, [prompt], 6)[0]
    monkeypatch.setattr(speculation, "propose_draft", lambda history, k=4, **_: np.array(
        (prompt + greedy)[len(history):len(history) + k] or [0]))
    spec = load(path, provider="cpu", capacity=64, chunk_size=W, speculative=SPEC)
    runs = 600
    counts: dict[str, dict[tuple, int]] = {"plain": {}, "spec": {}}
    accepted = 0
    for name, runtime in (("plain", plain), ("spec", spec)):
        for seed in range(runs):
            with runtime.open_sequence() as sequence:
                tokens = sequence.generate(prompt, 3, [], sampling=Sampling(
                    temperature=1.0, top_k=3, seed=seed))
                accepted += sequence.stats.accepted_tokens
            key = tuple(tokens[1:])
            counts[name][key] = counts[name].get(key, 0) + 1
    assert accepted > runs // 10, "the drafts were hardly ever kept: the test would be vacuous"
    keys = sorted(set(counts["plain"]) | set(counts["spec"]))
    table = np.array([[counts[name].get(key, 0) for key in keys] for name in counts], float)
    # Pool rare outcomes so every expected cell is at least 5.
    expected = table.sum(0, keepdims=True) * table.sum(1, keepdims=True) / table.sum()
    rare = expected.min(0) < 5
    if rare.any():
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], 1)
        expected = table.sum(0, keepdims=True) * table.sum(1, keepdims=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    degrees = table.shape[1] - 1
    # The upper 0.1% point of chi-square, by the Wilson-Hilferty approximation.
    bound = degrees * (1 - 2 / (9 * degrees) + 3.09 * (2 / (9 * degrees)) ** 0.5) ** 3
    assert statistic < bound, (keys, table)


def test_a_stream_closed_inside_a_verified_run_keeps_what_it_took(reference_model, monkeypatch):
    """The consumer stops after some tokens of a verification: the KV holds the prompt and
    the tokens it took but the last, as after plain decoding, and the next call continues."""
    path = reference_model("base")
    plain = load(path, provider="cpu", capacity=160, chunk_size=W)
    prompt = _prompts(plain.stats.vocab_size, (12,))[0]
    tokens = _alone(plain, [prompt], 30)[0]
    monkeypatch.setattr(speculation, "propose_draft", lambda history, k=4, **_: np.array(
        (prompt + tokens)[len(history):len(history) + k]))
    with load(path, provider="cpu", capacity=160, chunk_size=W, speculative=SPEC) as spec:
        for taken in (3, 6, 7):
            with spec.open_sequence() as sequence:
                stream = sequence.stream(prompt, 30, [])
                assert [next(stream) for _ in range(taken)] == tokens[:taken]
                stream.close()
                assert sequence.length == len(prompt) + taken - 1
                assert sequence.stats.accepted_tokens > 0


def test_each_accepted_token_carries_its_own_logprobs():
    """A verification's tokens are delivered with the logprobs of the row each was chosen
    from: every entry names its token, and the values are plain decoding's."""
    fixture = next(fixture for fixture in builder_gqa_fixtures()
                   if fixture.name == "genai-llama-fp32")
    sampling = Sampling(logprobs=3)
    with load(fixture.folder, provider="cpu", chunk_size=W) as plain:
        prompts = _prompts(plain.stats.vocab_size, (5, 64, 130), seed=1)
        expected = [plain.submit(prompt, 60, eos_token_id=[], sampling=sampling)
                    for prompt in prompts]
        expected = [(request.result(), request.logprobs) for request in expected]
    with load(fixture.folder, provider="cpu", chunk_size=W, speculative=SPEC) as spec:
        for prompt, (tokens, logprobs) in zip(prompts, expected):
            request = spec.submit(prompt, 60, eos_token_id=[], sampling=sampling)
            assert request.result() == tokens
            assert [entry.token for entry in request.logprobs] == tokens
            for ours, theirs in zip(request.logprobs, logprobs):
                assert [token for token, _ in ours.top] == [token for token, _ in theirs.top]
                np.testing.assert_allclose(ours.logprob, theirs.logprob, atol=1e-4)
        assert spec.stats.engine.accepted_tokens > 0
