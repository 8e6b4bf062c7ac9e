"""onnx-chunk's greedy tokens equal onnxruntime-genai's, live, on every builder export.

onnxruntime-genai runs in the peer venv (its CPU onnxruntime never shares a venv with
onnxruntime-gpu) and computes its tokens in this run: INT4 kernels differ between CPUs and
ONNX Runtime versions, so a stored reference would be wrong elsewhere. Both runtimes prefill
in chunks of the same width W and stop at the model's EOS. An INT4 case that differs must be a
near-tie (genai's top-2 logit margin at the first differing step under NEAR_TIE), reported as
an expected failure with the numbers; any other difference fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from onnx_chunk.runtime import load
from scripts._bench import environment
from scripts._bench.child import run_child
from tests.exports.corpus import builder_gqa_fixtures

WIDTHS = (512, 128)
NEW_TOKENS = 8
NEAR_TIE = 1e-3


def prompt_lengths(width: int) -> list[int]:
    return sorted({1, 40, width - 1, width, width + 1, 2 * width + 13, 1137, 1900})


def _prompts(fixture, width: int, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng([width, *fixture.name.encode()])
    return [rng.integers(0, vocab_size, length).tolist() for length in prompt_lengths(width)]


def genai_tokens(peer_python, folder, prompts, width: int, max_length: int) -> list[dict]:
    """genai's greedy results (tokens and top-2 margins per step) for `prompts` at width W."""
    child = run_child(environment.worker_argv(peer_python, "genai_worker", {
        "model": str(folder), "prompts": prompts, "new_tokens": NEW_TOKENS,
        "chunk_size": width, "margins": True, "max_length": max_length}), timeout_s=600)
    return child.payload["results"]


def first_difference(ours: list[int], theirs: list[int]) -> int:
    return next((step for step, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                min(len(ours), len(theirs)))


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("fixture", builder_gqa_fixtures(), ids=str)
def test_greedy_tokens_equal_genai_at_every_length(fixture, width, peer_python):
    runtime = load(fixture.folder, provider="cpu", chunk_size=width)
    prompts = _prompts(fixture, width, runtime.stats.vocab_size)
    theirs = genai_tokens(peer_python, fixture.folder, prompts, width, runtime.stats.capacity)
    sequence = runtime.open_sequence()
    differences, near_ties = [], []
    for prompt, reference in zip(prompts, theirs):
        sequence.rewind(sequence.length)
        ours = sequence.generate(prompt, NEW_TOKENS)
        if ours == reference["tokens"]:
            continue
        step = first_difference(ours, reference["tokens"])
        margin = reference["margins"][step] if step < len(reference["margins"]) else None
        line = (f"prompt {len(prompt)}: first difference at step {step}, genai's top-2 margin "
                f"{margin}; ours {ours}, genai {reference['tokens']}")
        tie = fixture.precision == "int4" and margin is not None and margin < NEAR_TIE
        (near_ties if tie else differences).append(line)
    assert not differences, f"{fixture} W={width}:\n" + "\n".join(differences)
    if near_ties:
        pytest.xfail(f"INT4 near-tie(s), not a defect: {'; '.join(near_ties)}")
