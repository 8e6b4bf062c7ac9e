"""Prefix reuse across requests: a slot keeps its KV after its request, and a later request whose
prompt starts with the kept ids prefills only the rest. Sharing a prefix never changes tokens:
every request is compared with the same request run with reuse off (a fresh slot each time), on
every export of the corpus the runtime serves and on the reference decoders, with what the
engine counted."""

import dataclasses

import numpy as np
import pytest

from onnx_chunk.cli import main
from onnx_chunk.errors import ConfigError
from onnx_chunk.runtime import facade, load
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for
from tests.exports.corpus import GENAI, fixtures

W = 16
NEW = 8
OPTIONS = {"provider": "cpu", "chunk_size": W, "max_batch": 2}
# The builder's fp16 CPU export attends with MultiHeadAttention, which the runtime refuses.
SERVED = [fixture for fixture in fixtures() if fixture.name != "genai-llama-fp16"]


def _ids(rng, vocab, count):
    return rng.integers(0, vocab, count).tolist()


def _script(vocab):
    """The requests of the parity run, built from each earlier answer (`answers`): a chat of
    four turns (each resends the conversation), a prompt sharing only the chat's first 25
    ids, the same prompt again, and a request that shares nothing. Returned as functions of
    the answers so far, so both runtimes see the prompts their own answers make."""
    rng = np.random.default_rng(3)
    first = _ids(rng, vocab, 40)
    tails = [_ids(rng, vocab, count) for count in (20, 30, 25)]
    side = first[:25] + _ids(rng, vocab, 15)
    other = _ids(rng, vocab, 33)

    def turn(index):
        def prompt(prompts, answers):
            return prompts[index - 1] + answers[index - 1] + tails[index - 1]
        return prompt

    return [lambda prompts, answers: first, turn(1), turn(2), turn(3),
            lambda prompts, answers: side, lambda prompts, answers: side,
            lambda prompts, answers: other]


def _run(runtime, script):
    prompts, answers, cached = [], [], []
    for make in script:
        prompt = make(prompts, answers)
        request = runtime.submit(prompt, NEW, eos_token_id=[])
        answers.append(request.result(timeout=60))
        prompts.append(prompt)
        cached.append(request.stats.cached_tokens)
    return prompts, answers, cached


def _together(runtime, prompts):
    requests = [runtime.submit(prompt, NEW, eos_token_id=[]) for prompt in prompts]
    return ([request.result(timeout=60) for request in requests],
            [request.stats.cached_tokens for request in requests])


def _assert_reuse_changes_no_token(path, **options):
    with load(path, **{**OPTIONS, **options}, prefix_reuse=False) as fresh:
        script = _script(fresh.stats.vocab_size)
        prompts, expected, none = _run(fresh, script)
        assert not any(none) and fresh.stats.engine.prefix_hits == 0
        recurrent = bool(fresh.debug.ports.state)
        # Two at once, beside each other's kept prefixes: a continuation and a repeat.
        pair = [prompts[5] + expected[5] + [1, 2, 3], prompts[6]]
        expected_pair, _ = _together(fresh, pair)
    with load(path, **{**OPTIONS, **options}) as reusing:
        got_prompts, got, cached = _run(reusing, script)
        assert got_prompts == prompts and got == expected
        got_pair, cached_pair = _together(reusing, pair)
        assert got_pair == expected_pair
        stats = reusing.stats.engine
    # Each chat turn reused the whole kept conversation: the earlier prompt and its answer
    # but the answer's last token, never fed (recurrent state and window caches included).
    for index in (1, 2, 3):
        assert cached[index] == len(prompts[index - 1]) + NEW - 1
    assert cached[0] == 0 and cached[6] == 0
    if recurrent:
        # Only an exact kept state is reused: a prompt that leaves the kept ids partway
        # starts empty, and the engine says it could not reuse what it shared.
        assert cached[4] == cached[5] == cached_pair[1] == 0 and stats.prefix_refused >= 3
    else:
        # The same prompt again reuses all but its last two ids.
        assert cached[5] == len(prompts[5]) - 2 and cached_pair[1] == len(prompts[6]) - 2
    assert cached_pair[0] == len(prompts[5]) + NEW - 1
    every = cached + cached_pair
    assert stats.prefix_hits == sum(count > 0 for count in every)
    assert stats.prefix_reused_tokens == sum(every)
    return cached, stats


@pytest.mark.parametrize("fixture", SERVED, ids=str)
def test_reused_prefixes_give_the_tokens_of_a_fresh_slot_on_every_export(fixture,
                                                                         tmp_path_factory):
    """Builder (llama, qwen3, phi3; gemma2's window caches, evicted past 48 rows; lfm2's conv
    state; fp32 and INT4), Optimum and torch.onnx exports (converted to GroupQueryAttention
    at capacity by `onnx-chunk convert`, as they are served)."""
    folder = fixture.folder
    if fixture.layout != GENAI:
        folder = tmp_path_factory.mktemp(fixture.name) / "converted"
        assert main(["convert", str(fixture.folder), "-o", str(folder),
                     "--chunk-size", str(W)]) == 0
    cached, stats = _assert_reuse_changes_no_token(folder)
    if fixture.features.get("sliding_window") == 32:
        # The side prompt shares 25 ids with a conversation its window cache evicted from:
        # no rewind to 25 is exact, so it starts empty.
        assert cached[4] == 0 and stats.prefix_refused >= 1
    elif not fixture.features.get("conv_state"):
        assert cached[4] == 25


@pytest.mark.parametrize("variant", ["base", "conv_hybrid", "position_ids", "inputs_embeds"])
def test_reused_prefixes_give_the_same_tokens_on_the_reference_decoders(reference_model,
                                                                        variant):
    _assert_reuse_changes_no_token(reference_model(variant))


@pytest.mark.parametrize("variant", ["base", "conv_hybrid"])
def test_reuse_on_the_device_path_with_the_capacity_mask(reference_model, monkeypatch, variant):
    """The CPU marked not host-visible, as CUDA looks: a kept slot's capacity-wide mask is
    rewound in place, rows copied through device buffers, per-width variants and padding."""
    device = dataclasses.replace(device_for("cpu"), host_visible=False,
                                 mask_policy=MaskPolicy.CAPACITY, specialize=True)
    monkeypatch.setattr(facade, "resolve_device", lambda *args: device)
    _assert_reuse_changes_no_token(reference_model(variant))


def test_reuse_is_reported_per_request_and_can_be_switched_off(reference_model):
    path = reference_model("base")
    prompt = list(range(1, 30))
    with load(path, provider="cpu", chunk_size=W, capacity=128) as runtime:
        assert runtime.stats.prefix_reuse and runtime.debug.options.prefix_reuse
        first = runtime.submit(prompt, 4, eos_token_id=[])
        first.result()
        second = runtime.submit(prompt + first.result() + [5, 6], 4, eos_token_id=[])
        second.result()
        # 29 + 3 kept ids reused; the 3 left (the last answer token and 2 ids) in one chunk.
        assert second.stats.cached_tokens == 32 and second.stats.prefill_chunks == 1
        assert first.stats.cached_tokens == 0
    with load(path, provider="cpu", chunk_size=W, capacity=128, prefix_reuse=False) as off:
        assert not off.stats.prefix_reuse
        off.submit(prompt, 4, eos_token_id=[]).result()
        again = off.submit(prompt, 4, eos_token_id=[])
        again.result()
        assert again.stats.cached_tokens == 0 and again.stats.prefill_chunks == 2
        assert off.stats.engine.prefix_hits == off.stats.engine.prefix_reused_tokens == 0
    with pytest.raises(ConfigError, match="prefix_reuse must be True or False"):
        load(path, provider="cpu", prefix_reuse="yes")


def test_a_failed_request_leaves_nothing_to_reuse(reference_model, monkeypatch):
    from onnx_chunk.runtime.runner.model_runner import ModelRunner

    path = reference_model("base")
    run = ModelRunner.run

    def fail_batched(self, slot, forward):
        if len(forward.rows) > 1:
            raise RuntimeError("decode forward failed")
        return run(self, slot, forward)

    prompt = list(range(1, 30))
    with load(path, provider="cpu", chunk_size=W, capacity=128, max_batch=2) as runtime:
        monkeypatch.setattr(ModelRunner, "run", fail_batched)
        with pytest.raises(RuntimeError):
            runtime.submit(prompt, 4, eos_token_id=[]).result(timeout=30)
        monkeypatch.undo()
        again = runtime.submit(prompt, 4, eos_token_id=[])
        again.result(timeout=30)
        assert again.stats.cached_tokens == 0
