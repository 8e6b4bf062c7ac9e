"""Decoders converted with a `logits_rows` input (`convert --logits-rows`, the default `auto`)
against the same exports converted without it, on the corpus of real exports: the runtime
feeds one row per prefill chunk and every real row where all rows are asked for, and greedy
tokens, prompt logprobs and speculative decoding are the same."""

import numpy as np
import pytest

from onnx_chunk.cli import main
from onnx_chunk.runtime import load
from onnx_chunk.runtime.runner import model_runner
from onnx_chunk.sampling import Sampling
from tests.exports.corpus import fixtures

W = 32
NEW_TOKENS = 8
# The builder's fp16 CPU export attends with MultiHeadAttention: nothing to convert.
CORPUS = [fixture for fixture in fixtures() if fixture.name != "genai-llama-fp16"]


def _prompt(length: int, offset: int = 3) -> list[int]:
    return [(7 * index + offset) % 200 for index in range(length)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{(name, mode): folder} for every export, converted with --logits-rows auto and off."""
    out = tmp_path_factory.mktemp("rows")
    folders = {}
    for fixture in CORPUS:
        for mode in ("auto", "off"):
            folder = out / mode / fixture.name
            assert main(["convert", str(fixture.folder), "-o", str(folder), "-q",
                         "--chunk-size", str(W), "--logits-rows", mode]) == 0
            folders[fixture.name, mode] = folder
    return folders


@pytest.fixture
def fed_rows(monkeypatch):
    """Every logits_rows value the runtime writes, in order."""
    fed: list[list[int]] = []
    original = model_runner.Binding.write_rows

    def recording(self, name, rows, device):
        fed.append(np.asarray(rows).tolist())
        return original(self, name, rows, device)

    monkeypatch.setattr(model_runner.Binding, "write_rows", recording)
    return fed


@pytest.mark.parametrize("fixture", CORPUS, ids=str)
def test_tokens_and_every_rows_logits_equal_the_decoder_without_the_input(converted, fixture,
                                                                          fed_rows):
    prompt = _prompt(2 * W + 6)
    results = {}
    for mode in ("off", "auto"):
        with load(converted[fixture.name, mode], provider="cpu") as runtime:
            assert (runtime.debug.ports.logits_rows == "logits_rows") == (mode == "auto")
            with runtime.open_sequence() as sequence:
                tokens = sequence.generate(prompt, NEW_TOKENS, [])
            fed = len(fed_rows)
            with runtime.open_sequence() as sequence:
                every = sequence.prefill(prompt, all_logits=True)
            results[mode] = tokens, every
            if mode == "auto":
                # A chunk of the plain prefill computed one row: its last real one (padded
                # remainders included), and so did each decode step.
                assert fed and all(len(rows) == 1 for rows in fed_rows[:fed])
                # The all-rows prefill fed every real row of each chunk.
                assert sorted({len(rows) for rows in fed_rows[fed:]}) == [6, W]
            else:
                assert not fed_rows
    assert results["auto"][0] == results["off"][0]
    assert every.shape == (len(prompt), runtime.stats.vocab_size)
    np.testing.assert_array_equal(results["auto"][1], results["off"][1])


@pytest.mark.parametrize("name", ["genai-llama-int4", "genai-gemma2-fp32", "genai-lfm2-fp32",
                                  "optimum-qwen2-fp32"])
def test_prompt_logprobs_through_the_batch_engine_are_unchanged(converted, name):
    prompts = [(_prompt(40) * 4)[:150], _prompt(70, offset=11), _prompt(9, offset=5)]
    scoring = Sampling(prompt_logprobs=2, logprobs=1)
    outcome = {}
    for mode in ("auto", "off"):
        with load(converted[name, mode], provider="cpu", max_batch=3) as runtime:
            # Several prompts' chunks in one forward where the decoder takes native chunks,
            # each row's last real row fed, and every real row for the prompt logprobs.
            requests = [runtime.submit(prompt, NEW_TOKENS, eos_token_id=[], sampling=scoring)
                        for prompt in prompts]
            outcome[mode] = [(request.result(), request.prompt_logprobs, request.logprobs)
                             for request in requests]
    assert outcome["auto"] == outcome["off"]
    assert all(len(logprobs) == len(prompt)
               for prompt, (_, logprobs, _) in zip(prompts, outcome["auto"]))


@pytest.mark.parametrize("name", ["genai-llama-fp32", "genai-gemma2-w4096-fp32", "genai-qwen3-fp32",
                                  "optimum-qwen2-fp32"])
def test_speculative_decoding_is_unchanged(converted, name):
    """Verification asks for the logits of every drafted row."""
    prompt = (list(range(3, 40)) * 6)[:200]
    outcome = {}
    for mode in ("auto", "off"):
        with load(converted[name, mode], provider="cpu",
                  speculative="prompt-lookup") as runtime:
            with runtime.open_sequence() as sequence:
                outcome[mode] = sequence.generate(prompt, 16, [])
                assert sequence.stats.draft_tokens > 0
    assert outcome["auto"] == outcome["off"]
