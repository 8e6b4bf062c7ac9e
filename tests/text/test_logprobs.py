"""Logprobs through the Python API (Runtime.generate_text, submit) and `generate --logprobs`,
against a plain ONNX Runtime forward of the whole sequence through the same export."""

from __future__ import annotations

import json

import numpy as np
import pytest

from onnx_chunk.cli import main
from onnx_chunk.errors import InputError
from onnx_chunk.runtime import load
from onnx_chunk.sampling import Sampling
from onnx_chunk.text.generation import generate_text
from onnx_chunk.text.tokenizer import tokenizer_of
from tests.exports.corpus import ROOT
from tests.exports.full_forward import full_sequence_logprobs

EXPORT = ROOT / "genai-qwen3-fp32"
PROMPT = "Paris is"
NEW = 5
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def runtime():
    with load(EXPORT, provider="cpu") as runtime:
        yield runtime


def _check(ids: list[int], tokens, logprobs, top: int) -> None:
    reference = full_sequence_logprobs(EXPORT, ids + list(tokens))
    assert [entry.token for entry in logprobs] == list(tokens)
    for step, entry in enumerate(logprobs):
        row = reference[len(ids) - 1 + step]
        assert abs(entry.logprob - row[entry.token]) <= TOLERANCE
        assert len(entry.top) == top
        assert np.allclose([value for _, value in entry.top], np.sort(row)[::-1][:top],
                           atol=TOLERANCE)
        assert [token for token, _ in entry.top] == sorted(
            (token for token, _ in entry.top), key=lambda token: -row[token])


def test_generate_text_gives_each_tokens_logprobs(runtime):
    completion = generate_text(runtime, PROMPT, NEW, sampling=Sampling(), ignore_eos=True,
                               logprobs=3)
    assert len(completion.logprobs) == len(completion.tokens) == NEW
    _check(tokenizer_of(runtime).encode(PROMPT), completion.tokens, completion.logprobs, 3)
    assert generate_text(runtime, PROMPT, NEW, sampling=Sampling()).logprobs == ()


def test_submit_with_prompt_logprobs_and_no_new_tokens(runtime):
    ids = tokenizer_of(runtime).encode(PROMPT + " a city of many lights")
    request = runtime.submit(ids, 0, sampling=Sampling(prompt_logprobs=1))
    assert request.result() == [] and request.finish_reason == "length"
    scored = request.prompt_logprobs
    assert scored[0] is None and len(scored) == len(ids)
    reference = full_sequence_logprobs(EXPORT, ids)
    assert np.allclose([entry.logprob for entry in scored[1:]],
                       [reference[position - 1, ids[position]]
                        for position in range(1, len(ids))], atol=TOLERANCE)
    with pytest.raises(InputError, match="max_new_tokens"):
        runtime.submit(ids, 0)


def test_a_sequence_refuses_logprobs(runtime):
    with runtime.open_sequence() as sequence, pytest.raises(InputError, match="logprobs"):
        sequence.generate([5, 6, 7], 2, sampling=Sampling(logprobs=1))


def test_generate_cli_prints_the_logprobs(runtime, capsys):
    assert main(["generate", str(EXPORT), "--prompt", PROMPT, "--max-new-tokens", str(NEW),
                 "--temperature", "0", "--ignore-eos", "--logprobs", "2", "--provider", "cpu",
                 "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)
    ids = tokenizer_of(runtime).encode(PROMPT)
    reference = full_sequence_logprobs(EXPORT, ids + entry["tokens"])
    assert [record["token"] for record in entry["logprobs"]] == entry["tokens"]
    for step, record in enumerate(entry["logprobs"]):
        assert abs(record["logprob"] - reference[len(ids) - 1 + step, record["token"]]) \
            <= TOLERANCE
        assert len(record["top"]) == 2
    assert main(["generate", str(EXPORT), "--prompt", PROMPT, "--max-new-tokens", "2",
                 "--temperature", "0", "--logprobs", "1", "--provider", "cpu"]) == 0
    assert len(capsys.readouterr().err.strip().splitlines()) >= 2
