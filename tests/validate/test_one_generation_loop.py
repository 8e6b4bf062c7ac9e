"""Validate generates only through the engine's step: every token it reports or feeds back was
chosen by the runtime's sampler in a request, and the logits it compares for a free-running
generation are the rows the sampler chose from."""

from __future__ import annotations

import weakref

import numpy as np
import pytest

from onnx_chunk.runtime import Request, Sequence, load
from onnx_chunk.sampling import Sampler
from onnx_chunk.validate import Outcome, ValidationOptions, validate_model
from onnx_chunk.validate.prompts import seeded_prompt
from onnx_chunk.validate.runs import greedy_generation
from tests.exports.corpus import builder_gqa_fixtures

from .conftest import CHUNK
from .mutations import copy_model, edit_graph

LENGTHS = (3, CHUNK + 1, 2 * CHUNK + 1)
NEW = 3


def _shift_the_runtimes_choice(monkeypatch) -> None:
    """Every choice of the runtime's sampler becomes the next id after it: a token chosen
    anywhere else (an argmax of rows validate reads itself) then differs from the runtime's."""
    choose = Sampler.choose

    def shifted(self, logits, draft=None):
        return (choose(self, logits, draft) + 1) % logits.shape[-1]

    monkeypatch.setattr(Sampler, "choose", shifted)


def _watch_what_validate_feeds(monkeypatch) -> tuple[list[tuple[int, ...]], list[int]]:
    """Record each request's prompt and tokens as they are delivered, and check every token fed
    to `Sequence.decode` against them: the ids fed to that sequence so far, then the token,
    must be the start of what a request had delivered by then. Returns the histories that
    were not (a token validate chose itself) and a one-item count of the decodes checked."""
    delivered: dict[int, tuple[int, ...]] = {}
    deliver = Request.deliver

    def recording(self, token, logprobs=None):
        reason = deliver(self, token, logprobs)
        delivered[self.id] = (*self.prompt.tolist(), *self.produced)
        return reason

    fed: weakref.WeakKeyDictionary[Sequence, list[int]] = weakref.WeakKeyDictionary()
    prefill, decode = Sequence.prefill, Sequence.decode

    def feeding(self, token_ids, **options):
        logits = prefill(self, token_ids, **options)
        fed.setdefault(self, []).extend(np.asarray(token_ids).tolist())
        return logits

    orphans: list[tuple[int, ...]] = []
    checked = [0]

    def checking(self, token):
        history = (*fed.setdefault(self, []), int(token))
        if not any(grown[:len(history)] == history for grown in delivered.values()):
            orphans.append(history)
        checked[0] += 1
        fed[self].append(int(token))
        return decode(self, token)

    monkeypatch.setattr(Request, "deliver", recording)
    monkeypatch.setattr(Sequence, "prefill", feeding)
    monkeypatch.setattr(Sequence, "decode", checking)
    return orphans, checked


def test_validate_follows_the_runtimes_token_choice_everywhere(reference_model, monkeypatch):
    model = reference_model("base")
    firsts = []
    with load(model, provider="cpu", capacity=64, chunk_size=64) as runtime:
        vocab = runtime.stats.vocab_size
        for length in LENGTHS:
            with runtime.open_sequence() as sequence:
                firsts.append(int(np.argmax(sequence.prefill(seeded_prompt(vocab, length, 0)))))
    _shift_the_runtimes_choice(monkeypatch)
    orphans, checked = _watch_what_validate_feeds(monkeypatch)
    report = validate_model(model, ValidationOptions(
        chunk_size=CHUNK, provider="cpu", lengths=LENGTHS, new_tokens=NEW, reference=model,
        reference_min_agreement=1.0, reference_max_logits_diff=0.0))
    checks = {check.name: check for check in report.checks}
    for name in ("numerics.greedy_tokens", "numerics.logits", "engine.batched_decode",
                 "reference.greedy_agreement", "reference.max_logits_diff"):
        assert checks[name].outcome is Outcome.PASSED, (name, checks[name].reason)
    # Teacher-forced runs fed only tokens the runtime's requests had chosen (and there were
    # some: the chunked, padded and reference-forced decodes).
    assert orphans == [] and checked[0] > 0
    # The tokens reported are the runtime's choices: the whole-prompt reference's first token
    # is the one after the argmax of its prompt's last row, and every run chose as it did.
    greedy = checks["numerics.greedy_tokens"].details
    assert [tokens[0] for tokens in greedy["tokens"]["whole"]] == [(first + 1) % vocab
                                                                   for first in firsts]
    assert greedy["tokens"]["chunked"] == greedy["tokens"]["padded"] == greedy["tokens"]["whole"]
    assert greedy["parted"] == []
    engine = checks["engine.batched_decode"].details
    assert engine["tokens"]["one_slot"] == engine["tokens"]["alone"]
    assert engine["one_slot_differences"] == []
    agreement = checks["reference.greedy_agreement"].details
    assert agreement["tokens"]["reference"] == greedy["tokens"]["whole"]


@pytest.mark.parametrize("fixture", builder_gqa_fixtures(), ids=str)
def test_a_generation_keeps_the_rows_its_tokens_were_chosen_from(fixture):
    """The rows `greedy_generation` keeps are bit for bit those of the same prompt fed and
    decoded on its tokens, and its tokens are a plain greedy generation's."""
    with load(fixture.folder, provider="cpu", chunk_size=CHUNK) as runtime:
        ids = seeded_prompt(runtime.stats.vocab_size, 2 * CHUNK + 3, 0)
        with runtime.open_sequence() as sequence:
            generation = greedy_generation(sequence, ids, 5)
            assert sequence.length == len(ids) + 4
        with runtime.open_sequence() as sequence:
            assert tuple(sequence.generate(ids, 5, ())) == generation.tokens
        with runtime.open_sequence() as sequence:
            rows = [sequence.prefill(ids)]
            rows += [sequence.decode(token) for token in generation.tokens[:-1]]
    assert len(generation.rows) == len(rows) == 5
    for kept, scored in zip(generation.rows, rows):
        np.testing.assert_array_equal(kept, scored)


def test_logits_with_no_finite_maximum_fail_the_runs_with_one_reason(reference_model, tmp_path):
    """A decoder whose logits are NaN: no token can be chosen, and the numerics say so."""
    model = copy_model(reference_model("base"), tmp_path / "nan")

    def poison(proto):
        from onnx import TensorProto, helper

        producer = next(node for node in proto.graph.node if "logits" in node.output)
        producer.output[list(producer.output).index("logits")] = "logits_before_nan"
        nan = helper.make_tensor("nan", TensorProto.FLOAT, [], [float("nan")])
        proto.graph.initializer.append(nan)
        proto.graph.node.append(helper.make_node("Mul", ["logits_before_nan", "nan"],
                                                 ["logits"]))

    edit_graph(model, poison)
    report = validate_model(model, ValidationOptions(chunk_size=CHUNK, provider="cpu",
                                                     lengths=(3,), new_tokens=2))
    checks = {check.name: check for check in report.checks}
    for name in ("numerics.greedy_tokens", "numerics.logits", "numerics.kv_prefix",
                 "engine.batched_decode"):
        assert checks[name].outcome is Outcome.FAILED, name
        assert "no token can be chosen on a prompt of 3 tokens" in checks[name].reason
