"""Several choices of one prompt (`Runtime.submit_choices`, OpenAI's `n`): one prefill, the
other choices forked from a device copy of its KV and state rows; each choice gives what a
request of its own with its sampling gives (real exports, one with recurrent state)."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_chunk.runtime import facade, load
from onnx_chunk.runtime.engine.scheduler import prefill_chunks
from onnx_chunk.sampling import Sampling
from tests.exports.corpus import ROOT
from tests.exports.full_forward import full_sequence_logprobs
from tests.runtime.test_device_path import DEVICE_LIKE

NEW_TOKENS = 6
CHUNK = 16


def _samplings(count: int, **options) -> list[Sampling]:
    return [Sampling(temperature=1.0, seed=40 + index, **options) for index in range(count)]


def _alone(runtime, prompt, sampling) -> list[int]:
    return runtime.submit(prompt, NEW_TOKENS, eos_token_id=[], sampling=sampling).result()


@pytest.mark.parametrize("name", ["genai-qwen3-fp32", "genai-lfm2-fp32"])
def test_choices_equal_requests_of_their_own_after_one_prefill(name):
    # Prefix reuse off: the requests alone would leave the prompt kept for the choices.
    with load(ROOT / name, provider="cpu", max_batch=4, chunk_size=CHUNK,
              prefix_reuse=False) as runtime:
        vocab = runtime.stats.vocab_size
        prompt = list(np.random.default_rng(1).integers(5, vocab, 2 * CHUNK + 5))
        samplings = _samplings(3, logprobs=1)
        expected = [_alone(runtime, prompt, sampling) for sampling in samplings]
        before = runtime.stats.engine.prefill_chunks
        requests = runtime.submit_choices(prompt, NEW_TOKENS, samplings, eos_token_id=[])
        assert [request.result() for request in requests] == expected
        assert runtime.stats.engine.prefill_chunks - before == \
            len(prefill_chunks(len(prompt), CHUNK))
        assert all(len(request.logprobs) == NEW_TOKENS for request in requests)
        assert len({tuple(tokens) for tokens in expected}) > 1


def test_choices_without_a_free_slot_run_on_their_own():
    with load(ROOT / "genai-qwen3-fp32", provider="cpu", max_batch=1,
              prefix_reuse=False) as runtime:
        prompt = [5, 17, 200, 42, 99, 7]
        samplings = _samplings(3)
        expected = [_alone(runtime, prompt, sampling) for sampling in samplings]
        before = runtime.stats.engine.prefill_chunks
        requests = runtime.submit_choices(prompt, NEW_TOKENS, samplings, eos_token_id=[])
        assert [request.result() for request in requests] == expected
        assert runtime.stats.engine.prefill_chunks - before == 3


def test_choices_share_the_prompt_logprobs_and_a_cancel_ends_one():
    with load(ROOT / "genai-qwen3-fp32", provider="cpu", max_batch=3) as runtime:
        prompt = [5, 17, 200, 42, 99, 7]
        requests = runtime.submit_choices(prompt, 0, _samplings(2, prompt_logprobs=0))
        assert [request.result() for request in requests] == [[], []]
        assert requests[0].prompt_logprobs == requests[1].prompt_logprobs
        assert len(requests[1].prompt_logprobs) == len(prompt)
        requests = runtime.submit_choices(prompt, 50, _samplings(2), eos_token_id=[])
        requests[1].cancel()
        assert len(requests[0].result()) == 50
        assert requests[1].finish_reason == "cancelled"


@pytest.mark.parametrize("name", ["genai-qwen3-fp32", "genai-lfm2-fp32"])
def test_choices_and_logprobs_on_the_device_path(name, monkeypatch):
    """The CPU marked not host-visible, as CUDA looks: the fork's copy runs through the device
    buffers' addresses (no host view), prompt logprobs through the runner's "all" rows of
    row-selecting prefill sessions."""
    monkeypatch.setattr(facade, "resolve_device", lambda *args: DEVICE_LIKE)
    with load(ROOT / name, provider="cpu", max_batch=3, chunk_size=CHUNK) as runtime:
        # Prefill widths return one logits row there: "all" binds their full output instead.
        assert not runtime.debug.device.host_visible and runtime.debug.options.select_rows
        vocab = runtime.stats.vocab_size
        prompt = list(np.random.default_rng(2).integers(5, vocab, CHUNK + 7))
        samplings = _samplings(2, logprobs=2, prompt_logprobs=1)
        expected = [_alone(runtime, prompt, sampling) for sampling in samplings]
        requests = runtime.submit_choices(prompt, NEW_TOKENS, samplings, eos_token_id=[])
        assert [request.result() for request in requests] == expected
        reference = full_sequence_logprobs(ROOT / name, prompt)
        scored = requests[1].prompt_logprobs
        assert np.allclose([entry.logprob for entry in scored[1:]],
                           [reference[position - 1, prompt[position]]
                            for position in range(1, len(prompt))], atol=1e-4)
