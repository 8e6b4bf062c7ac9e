"""Exact mode: a request's numbers do not depend on how its rows were grouped, bit for bit:
chunked as whole, batched as alone, a reused prefix as a fresh prefill (docs/row_grouping.md).

ONNX Runtime's kernels round some rows by how their forward is cut; the corpus exports show it
on this CPU only at some widths, so the tests also run the corpus with a fake kernel in the
graph that rounds by row count on every CPU (tests/validate/mutations.py): the default mode
then differs, exact mode does not."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from onnx_chunk import Sampling, load
from onnx_chunk.errors import CapacityError, ConfigError
from onnx_chunk.runtime.engine.prefix_reuse import KeptPrefix, PrefixRule, choose_slot
from onnx_chunk.runtime.runner.padding import even_width, plan_forward
from tests.exports.corpus import ROOT
from tests.validate.mutations import edit_graph, rounds_by_row_count

W = 8
OPTIONS = {"provider": "cpu", "chunk_size": W, "capacity": 96}


def test_an_odd_prompt_forward_gets_one_padded_row():
    assert [even_width(width, None) for width in (1, 2, 3, 8, 17)] == [1, 2, 4, 8, 18]
    assert even_width(17, 18) == 18
    with pytest.raises(CapacityError, match="exact mode pads a forward of 17 rows to 18"):
        even_width(17, 17)
    forward = plan_forward(np.arange(5), past=3, tiers=(4, 8), enabled=False, even=True)
    assert forward.width == 6 and forward.real_rows == 5 and forward.next_past == 8
    assert forward.tokens.tolist() == [0, 1, 2, 3, 4, 4]
    # With the ladder on, the tier first, then an even width.
    assert plan_forward(np.arange(5), past=0, tiers=(3, 7), even=True).width == 8


def test_exact_mode_rounds_odd_ladder_tiers_up(reference_model):
    with load(reference_model(), provider="cpu", chunk_size=512, padding=True) as runtime:
        assert runtime.stats.ladder == (171, 342, 512)
    with load(reference_model(), provider="cpu", chunk_size=512, padding=True,
              exact=True) as runtime:
        assert runtime.stats.ladder == (172, 342, 512)


def test_exact_reuse_keeps_the_prompt_rows_and_leaves_two_ids_to_feed():
    rule = PrefixRule(exact=True)
    assert rule.kept(prompt=10, length=14) == 10 and PrefixRule().kept(10, 14) == 14
    kept = {0: KeptPrefix(np.arange(10))}
    prompt = np.arange(11)
    # Two ids are left to feed in either mode (a one-row forward runs the one-row kernels).
    assert choose_slot(kept, prompt, PrefixRule()).reused == 9
    assert choose_slot(kept, prompt, rule).reused == 9
    assert choose_slot(kept, np.arange(2), rule).reused == 0


def test_exact_mode_refuses_what_cannot_be_exact(reference_model):
    with pytest.raises(ConfigError, match="cannot run in exact mode"):
        load(reference_model(), provider="cpu", speculative="prompt-lookup", exact=True)
    with pytest.raises(ConfigError, match="exact mode cannot run .* last row's logits only"):
        load(reference_model("last_token_logits"), provider="cpu", exact=True)
    with pytest.raises(ConfigError, match="exact must be True or False"):
        load(reference_model(), provider="cpu", exact="yes")


def test_a_native_folder_runs_the_repeat_path_in_exact_mode(tmp_path):
    from onnx_chunk.cli import main

    target = tmp_path / "conv" / "model.onnx"
    assert main(["convert", str(ROOT / "genai-llama-int4"), "-o", str(target),
                 "--chunk-size", str(W)]) == 0
    with load(target.parent, **OPTIONS, padding=True) as runtime:
        native = runtime.stats.padding
    with load(target.parent, **OPTIONS, padding=True, exact=True) as runtime:
        assert runtime.stats.exact and runtime.stats.padding == "repeat"
    assert native == "native"


def _faked(tmp_path, name, kind):
    folder = tmp_path / f"{name}-{kind.replace(' ', '-')}"
    shutil.copytree(ROOT / name, folder)
    edit_graph(folder / "model.onnx", rounds_by_row_count(layer=0, kind=kind))
    return folder


def _prompt(vocab, length, seed=0):
    return np.random.default_rng([seed, length]).integers(0, vocab, length)


@pytest.mark.parametrize("name", ["genai-llama-fp32", "genai-llama-int4", "genai-qwen3-int4"])
def test_chunked_equals_whole_in_exact_mode(tmp_path, name):
    """Lengths 17 and 25 (k x 8 + 1) leave the whole forward's last row alone in its block."""
    folder = _faked(tmp_path, name, "lone block")
    rows = {}
    for exact in (False, True):
        for chunk in (W, 96):
            with load(folder, **{**OPTIONS, "chunk_size": chunk}, exact=exact) as runtime:
                vocab = runtime.stats.vocab_size
                for length in (5, 9, 17, 25, 30):
                    with runtime.open_sequence() as sequence:
                        rows[exact, chunk, length] = sequence.prefill(_prompt(vocab, length))
    lengths = (5, 9, 17, 25, 30)
    assert all(np.array_equal(rows[True, W, length], rows[True, 96, length])
               for length in lengths)
    assert not all(np.array_equal(rows[False, W, length], rows[False, 96, length])
                   for length in lengths)


def _answers(runtime, prompts, logprobs=1):
    sampling = Sampling(logprobs=logprobs)
    requests = [runtime.submit(prompt, 6, eos_token_id=[], sampling=sampling)
                for prompt in prompts]
    return [(request.result(timeout=60), [step.logprob for step in request.logprobs])
            for request in requests]


@pytest.mark.parametrize("name", ["genai-llama-int4", "genai-qwen3-int4"])
def test_reuse_and_batching_change_no_number_in_exact_mode(tmp_path, name):
    """A kernel that rounds one-row forwards (decode steps) apart: in the default mode a reused
    conversation reads its answers' KV as decode steps computed it and parts from a fresh
    prefill; in exact mode a slot keeps its prompt's rows only, and every answer's tokens and
    logprobs equal the fresh ones bit for bit, batched or alone."""
    folder = _faked(tmp_path, name, "one row")

    def conversation(runtime, together):
        vocab = runtime.stats.vocab_size
        first = _prompt(vocab, 13).tolist()
        (answer, _), = _answers(runtime, [first])
        follow = first + answer + _prompt(vocab, 6, seed=1).tolist()
        other = _prompt(vocab, 11, seed=2).tolist()
        if together:
            return _answers(runtime, [follow, other])
        return _answers(runtime, [follow]) + _answers(runtime, [other])

    results = {}
    for exact in (False, True):
        for reuse in (False, True):
            for together in (False, True):
                with load(folder, **OPTIONS, max_batch=2, prefix_reuse=reuse,
                          exact=exact) as runtime:
                    results[exact, reuse, together] = conversation(runtime, together)
                    if reuse:
                        assert runtime.stats.engine.prefix_reused_tokens > 0
    exact = [results[True, reuse, together] for reuse in (False, True)
             for together in (False, True)]
    assert all(result == exact[0] for result in exact)
    assert results[False, True, False] != results[False, False, False]
