"""Optimum and torch.onnx exports, rewritten from concat KV to GroupQueryAttention at capacity.

The reference is the unmodified export run by a plain ORT loop that feeds the grown KV back
(tests/exports/grown_kv.py): the converted model's greedy tokens equal it at every prompt
length through chunked prefill, ladder padding and the variant cache, its next-token logits
are within 1e-5 on CPU, and the three llama exports (builder, Optimum, torch.onnx: the same
weights) give the same tokens. Both targets of `convert --kv-cache` are held to it:
GroupQueryAttention and opset 24 TensorScatter + Attention. Then the commands a user runs:
convert, inspect, generate, validate.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from onnx_chunk.cli import main
from onnx_chunk.runtime import load
from tests.cli_output import validate_passes
from tests.exports.corpus import GENAI, fixtures
from tests.exports.grown_kv import PAST_PREFIX, grown_kv_greedy
from tests.models._ort import run, session

WIDTH = 512
LENGTHS = (1, 40, WIDTH - 1, WIDTH + 1, 1137)
NEW_TOKENS = 8
# The next-token row (what greedy reads) within 1e-5; every prompt row within 2e-5: the sums
# over a long prompt round differently in GQA than in MatMul+Softmax (measured at 1137 rows:
# 1.2e-5 to 1.3e-5 on some row, 2e-6 to 4e-6 on the last; docs/standard_onnx.md).
LOGITS_ATOL = 1e-5
ALL_ROWS_ATOL = 2e-5
MAX_POSITIONS = 2048
STANDARD = [fixture for fixture in fixtures() if fixture.layout != GENAI]
LLAMA = ("genai-llama-fp32", "optimum-llama-fp32", "torch-llama-opset23")
# `convert --kv-cache`: GroupQueryAttention (default) or opset 24 TensorScatter + Attention.
TARGETS = ("gqa", "onnx24")
# validate's lengths: one chunk, and two with a remainder (the long prompts are covered above).
VALIDATE_LENGTHS = f"1,40,{WIDTH + 1}"


def _cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _prompts(vocab_size: int = 384) -> list[list[int]]:
    rng = np.random.default_rng(17)
    return [rng.integers(0, vocab_size, length).tolist() for length in LENGTHS]


@pytest.fixture(scope="module")
def converted_to(tmp_path_factory):
    """Each standard export converted once per KV cache target by `onnx-chunk convert`
    (W = 512), keyed by (fixture name, target)."""
    folders = {}
    for fixture in STANDARD:
        for target in TARGETS:
            folder = tmp_path_factory.mktemp(f"{fixture.name}-{target}") / "conv"
            assert main(["convert", str(fixture.folder), "-o", str(folder),
                         "--chunk-size", str(WIDTH), "--kv-cache", target]) == 0
            folders[fixture.name, target] = folder
    return folders


@pytest.fixture
def converted(converted_to):
    """The default (GroupQueryAttention) conversions, keyed by fixture name."""
    return {name: folder for (name, target), folder in converted_to.items() if target == "gqa"}


def test_the_corpus_has_the_standard_exports():
    assert {fixture.name for fixture in STANDARD} >= {
        "optimum-llama-fp32", "optimum-qwen2-fp32", "optimum-llama-tied-fp32",
        "torch-llama-opset23"}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fixture", STANDARD, ids=str)
def test_greedy_tokens_equal_the_grown_kv_loop_at_every_length(fixture, target, converted_to):
    runtime = load(converted_to[fixture.name, target], provider="cpu", chunk_size=WIDTH)
    assert runtime.stats.capacity == MAX_POSITIONS
    sequence = runtime.open_sequence()
    for prompt in _prompts():
        reference, _ = grown_kv_greedy(fixture.folder / "model.onnx", prompt, NEW_TOKENS)
        sequence.rewind(sequence.length)
        assert sequence.generate(prompt, NEW_TOKENS) == reference, len(prompt)
    assert runtime.stats.cache.compiles <= runtime.debug.plan.max_variants


@pytest.mark.parametrize("name", ["optimum-llama-fp32", "torch-llama-opset23"])
def test_a_capacity_wide_mask_with_ladder_padding_gives_the_same_tokens(name, converted):
    """What CUDA runs (every input but the query rows fixed), here on CPU."""
    fixture = next(fixture for fixture in STANDARD if fixture.name == name)
    runtime = load(converted[name], provider="cpu", chunk_size=WIDTH, mask_policy="capacity",
                   padding=True)
    sequence = runtime.open_sequence()
    for prompt in _prompts():
        reference, _ = grown_kv_greedy(fixture.folder / "model.onnx", prompt, NEW_TOKENS)
        sequence.rewind(sequence.length)
        assert sequence.generate(prompt, NEW_TOKENS) == reference, len(prompt)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fixture", STANDARD, ids=str)
def test_prompt_logits_match_the_export_at_capacity(fixture, target, converted_to):
    rewritten = session(converted_to[fixture.name, target] / "model.onnx")
    for prompt in _prompts():
        _, reference = grown_kv_greedy(fixture.folder / "model.onnx", prompt, 1)
        feeds = {value.name: np.zeros((1, value.shape[1], MAX_POSITIONS, value.shape[3]),
                                      np.float32)
                 for value in rewritten.get_inputs() if value.name.startswith(PAST_PREFIX)}
        if any(value.name == "query_seqlens" for value in rewritten.get_inputs()):
            feeds["query_seqlens"] = np.array([len(prompt)], np.int32)  # native chunks
        outputs = run(rewritten, {"input_ids": np.asarray([prompt], np.int64),
                                  "attention_mask": np.ones((1, len(prompt)), np.int64),
                                  "position_ids": np.arange(len(prompt))[None], **feeds})
        difference = np.abs(outputs["logits"][0] - reference)
        assert difference[-1].max() <= LOGITS_ATOL, len(prompt)
        assert difference.max() <= ALL_ROWS_ATOL, len(prompt)


def test_the_three_llama_exports_give_the_same_tokens(converted):
    folders = {"genai-llama-fp32": next(fixture.folder for fixture in fixtures(GENAI)
                                        if fixture.name == "genai-llama-fp32"),
               **{name: converted[name] for name in LLAMA[1:]}}
    runs = {}
    for name in LLAMA:
        sequence = load(folders[name], provider="cpu", chunk_size=WIDTH).open_sequence()
        runs[name] = []
        for prompt in _prompts():
            sequence.rewind(sequence.length)
            runs[name].append(sequence.generate(prompt, NEW_TOKENS))
    assert runs[LLAMA[0]] == runs[LLAMA[1]] == runs[LLAMA[2]]


@pytest.mark.parametrize("fixture", STANDARD, ids=str)
def test_inspect_reports_the_rewrite_and_the_rewritten_plan(fixture, capsys):
    code, out, err = _cli(capsys, "inspect", fixture.folder, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["concat_kv"]["rewritable"] and len(report["concat_kv"]["layers"]) == 2
    assert report["gqa_nodes"] == 2 and len(report["kv_bindings"]) == 4
    assert report["max_sequence_length"] == MAX_POSITIONS
    assert report["position_ids"] == "position_ids" and report["padding"]["eligible"]
    code, out, err = _cli(capsys, "inspect", fixture.folder)
    assert code == 0 and "GroupQueryAttention at capacity" in out, err


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fixture", STANDARD, ids=str)
def test_generate_and_validate_run_the_converted_folder(fixture, target, converted_to, capsys):
    folder = converted_to[fixture.name, target]
    code, out, err = _cli(capsys, "generate", folder, "--ids", "1,40,41,42,43,44",
                          "--max-new-tokens", NEW_TOKENS, "--provider", "cpu", "--json")
    assert code == 0, err
    reference, _ = grown_kv_greedy(fixture.folder / "model.onnx", [1, 40, 41, 42, 43, 44],
                                   NEW_TOKENS)
    assert json.loads(out)["tokens"] == reference
    validate_passes(capsys, folder, VALIDATE_LENGTHS)


def test_in_place_twice_and_without_config_json_a_capacity_is_needed(tmp_path, capsys):
    fixture = next(fixture for fixture in STANDARD if fixture.name == "torch-llama-opset23")
    folder = fixture.copy_to(tmp_path / "model")
    (folder / "config.json").unlink()
    code, out, err = _cli(capsys, "convert", folder, "--in-place")
    assert code == 0 and "max sequence length: unknown" in out, err
    code, out, err = _cli(capsys, "convert", folder, "--in-place")
    assert code == 0 and "already converted" in out, err
    prompt = "1,40,41,42,43,44"
    code, _, err = _cli(capsys, "generate", folder, "--ids", prompt, "--max-new-tokens", 8,
                        "--provider", "cpu")
    assert code == 2 and err.startswith("error:") and "--capacity" in err and \
        err.count("\n") == 1, err
    code, out, err = _cli(capsys, "generate", folder, "--ids", prompt, "--max-new-tokens", 8,
                          "--provider", "cpu", "--capacity", 256, "--json")
    reference, _ = grown_kv_greedy(fixture.folder / "model.onnx", [1, 40, 41, 42, 43, 44], 8)
    assert code == 0 and json.loads(out)["tokens"] == reference, err
