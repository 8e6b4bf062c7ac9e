"""A quantized KV cache (`convert --kv-dtype int8|int4`) runs on every path of the runtime.

Every GroupQueryAttention export of the corpus (llama, qwen3, phi3, gemma2 with its window
caches, lfm2 with its conv state; fp32 and INT4 weights) is converted with int8 and int4
caches; the runtime then allocates the int8 / packed uint8 buffers the graph declares and
runs a lone sequence, the engine at 4 slots, prefix reuse and speculative verification. The
models have random weights, so the greedy agreement with the float cache is measured and
printed, not held to a high number. Calibration runs on the prompts the tests feed (token ids):
a random model's keys depend on each token so much that ranges measured on other tokens clip
(docs/kv_cache.md); on its own prompts the cache holds every value in range, and the prompt's
logits are held close to the float cache's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from onnx_chunk.calibration import calibrate_kv
from onnx_chunk.graph.model_io import load_model, save_model
from onnx_chunk.passes import convert_model
from onnx_chunk.runtime import load
from scripts._bench import environment
from tests.exports.corpus import builder_gqa_fixtures

W = 32
NEW = 16
SLOTS = 4
FIXTURES = builder_gqa_fixtures()
KV_DTYPES = ("int8", "int4")
# Every (export, cache type) that converts: the kernel has no int4 window-sized cache at head
# size 16 (gemma2's; the refusal is tested in tests/passes/test_kv_quantization.py).
CASES = [pytest.param(fixture, kv_dtype, id=f"{fixture}-{kv_dtype}")
         for fixture in FIXTURES for kv_dtype in KV_DTYPES
         if not (kv_dtype == "int4" and fixture.features.get("sliding_window"))]
# What the float-cache logits of a prompt may move by, relative to their spread (largest
# minus smallest), with the cache quantized and calibrated on that prompt: int8 rounds each
# value to 1/254 of its range, int4 to 1/14 (measured on the corpus: see the printed drifts).
LOGITS_DRIFT = {"int8": 0.05, "int4": 0.5}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The converted folder of (fixture, kv_dtype), made once per module."""
    made: dict[tuple[str, str], Path] = {}

    def folder(fixture, kv_dtype: str) -> Path:
        key = (fixture.name, kv_dtype)
        if key not in made:
            vocab = json.loads((fixture.folder / "genai_config.json").read_text())["model"][
                "vocab_size"]
            calibration = calibrate_kv(fixture.folder, _prompts(vocab), source="test prompts")
            model = load_model(fixture.folder / "model.onnx")
            model = convert_model(model, chunk_size=W, kv_dtype=kv_dtype,
                                  calibration=calibration).model
            target = tmp_path_factory.mktemp(f"{fixture.name}-{kv_dtype}") / "model.onnx"
            save_model(model, target, companions_from=fixture.folder)
            made[key] = target.parent
        return made[key]

    return folder


def _prompts(vocab: int, lengths=(5, 40, 77), seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for length in lengths]


def _alone(runtime, prompts, new=NEW) -> list[list[int]]:
    results = []
    for prompt in prompts:
        with runtime.open_sequence() as sequence:
            results.append(sequence.generate(prompt, new, eos_token_id=[]))
    return results


def _agreement(ours: list[list[int]], float_cache: list[list[int]]) -> float:
    pairs = [(a, b) for x, y in zip(ours, float_cache) for a, b in zip(x, y)]
    return sum(a == b for a, b in pairs) / len(pairs)


@pytest.mark.parametrize(("fixture", "kv_dtype"), CASES)
def test_sequence_and_engine_run_the_quantized_cache(fixture, kv_dtype, quantized, capsys):
    folder = quantized(fixture, kv_dtype)
    with load(fixture.folder, provider="cpu", chunk_size=W) as plain:
        prompts = _prompts(plain.stats.vocab_size)
        float_tokens = _alone(plain, prompts)
        with plain.open_sequence() as sequence:
            float_logits = sequence.prefill(prompts[2], all_logits=True)
        float_stats = plain.stats
    with load(folder, provider="cpu", chunk_size=W, max_batch=SLOTS) as runtime:
        stats = runtime.stats
        assert stats.kv_dtype == kv_dtype
        # int8: one byte a value, a quarter of float32's; int4: two values a byte, an eighth.
        assert stats.kv_bytes * (4 if kv_dtype == "int8" else 8) == float_stats.kv_bytes
        expected_type = np.int8 if kv_dtype == "int8" else np.uint8
        with runtime.open_sequence() as sequence:
            assert all(buffer.dtype == expected_type for buffer in sequence.buffers.kv)
            logits = sequence.prefill(prompts[2], all_logits=True)
        alone = _alone(runtime, prompts)
        # The engine decodes up to 4 rows a step over the same quantized buffers.
        assert runtime.generate_many(prompts * 2, NEW, eos_token_id=[]) == alone * 2
        assert runtime.stats.engine.decode_steps > 0
    spread = float(float_logits.max() - float_logits.min())
    drift = float(np.abs(logits - float_logits).max()) / spread
    assert drift < LOGITS_DRIFT[kv_dtype]
    with capsys.disabled():
        print(f"\n{fixture} {kv_dtype}: greedy agreement with the float cache "
              f"{_agreement(alone, float_tokens):.2f} over {len(prompts)}x{NEW} tokens, "
              f"prompt logits drift {drift:.4f} of their spread")


@pytest.mark.parametrize(("fixture", "kv_dtype"), CASES)
def test_prefix_reuse_over_a_quantized_cache_changes_no_token(fixture, kv_dtype, quantized):
    folder = quantized(fixture, kv_dtype)
    options = {"provider": "cpu", "chunk_size": W, "max_batch": 2}
    with load(folder, **options, prefix_reuse=False) as fresh:
        first = _prompts(fresh.stats.vocab_size, (30,))[0]
        answer = fresh.submit(first, NEW, eos_token_id=[]).result(timeout=120)
        follow = first + answer + [5, 6, 7]
        expected = fresh.submit(follow, NEW, eos_token_id=[]).result(timeout=120)
    with load(folder, **options) as reusing:
        assert reusing.submit(first, NEW, eos_token_id=[]).result(timeout=120) == answer
        request = reusing.submit(follow, NEW, eos_token_id=[])
        assert request.result(timeout=120) == expected
        if not fixture.features.get("conv_state"):
            assert request.stats.cached_tokens == len(first) + NEW - 1


@pytest.mark.parametrize(("fixture", "kv_dtype"), [
    case for case in CASES if case.values[0].model_type != "lfm2"])
def test_speculative_verification_over_a_quantized_cache_keeps_greedy_tokens(fixture, kv_dtype,
                                                                             quantized):
    """Prompt-lookup drafts are verified in one multi-row forward that writes quantized rows,
    and rejected rows are rewound; the greedy tokens are plain decoding's (a lone sequence and
    a 2-slot engine)."""
    folder = quantized(fixture, kv_dtype)
    with load(folder, provider="cpu", chunk_size=W, max_batch=2) as plain:
        vocab = plain.stats.vocab_size
        rng = np.random.default_rng(5)
        motif = rng.integers(3, vocab, 6).tolist()
        prompts = [motif * 6, rng.integers(3, vocab, 20).tolist() + motif * 4,
                   rng.integers(3, vocab, 3).tolist() * 9]
        expected = _alone(plain, prompts, 40)
        # At its own slot count: INT4 MatMulNBits may pick other kernels for two rows.
        engine = plain.generate_many(prompts, 40, eos_token_id=[])
    with load(folder, provider="cpu", chunk_size=W, max_batch=2,
              speculative="prompt-lookup") as spec:
        drafted = 0
        for prompt, tokens in zip(prompts, expected):
            with spec.open_sequence() as sequence:
                assert sequence.generate(prompt, 40, eos_token_id=[]) == tokens
                drafted += sequence.stats.draft_tokens
        assert spec.generate_many(prompts, 40, eos_token_id=[]) == engine
        drafted += spec.stats.engine.draft_tokens
    # A random INT4-weight decoder is rarely sure enough of its next token for a draft to pay
    # (onnx_chunk.runtime.engine.speculation, rule 2); a float one drafts.
    assert drafted > 0 or fixture.precision != "fp32"


def test_onnxruntime_genai_runs_the_quantized_folder(quantized, peer_python):
    """onnxruntime-genai 0.18 with the peer venv's ONNX Runtime (1.32) runs the converted
    folder and gives onnx-chunk's greedy tokens. Its genai_config.json is the export's as it
    is: genai reads the cache's type and packed width from the model's inputs."""
    fixture = next(fixture for fixture in FIXTURES if fixture.name == "genai-llama-fp32")
    for kv_dtype in KV_DTYPES:
        folder = quantized(fixture, kv_dtype)
        assert json.loads((folder / "genai_config.json").read_text()) == json.loads(
            (fixture.folder / "genai_config.json").read_text())
        with load(folder, provider="cpu") as runtime:
            prompts = _prompts(runtime.stats.vocab_size, (9, 40))
            ours = [runtime.open_sequence().generate(prompt, 8) for prompt in prompts]
        child = subprocess.run(environment.worker_argv(peer_python, "genai_worker", {
            "model": str(folder), "prompts": prompts, "new_tokens": 8, "chunk_size": 0}),
            capture_output=True, text=True, timeout=300, check=True)
        theirs = [result["tokens"] for result in json.loads(child.stdout)["results"]]
        assert theirs == ours


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_device_path_runs_the_quantized_cache(kv_dtype, quantized, monkeypatch):
    """The CPU marked not host-visible, as CUDA looks: the int8 / uint8 buffers are allocated
    on the device and written and read through partial copies, with the capacity-wide mask."""
    import dataclasses

    from onnx_chunk.runtime import facade
    from onnx_chunk.runtime.device.provider import MaskPolicy, device_for

    fixture = next(fixture for fixture in FIXTURES if fixture.name == "genai-llama-fp32")
    folder = quantized(fixture, kv_dtype)
    with load(folder, provider="cpu", chunk_size=W, max_batch=2) as host:
        prompts = _prompts(host.stats.vocab_size)
        expected = _alone(host, prompts)
    device = dataclasses.replace(device_for("cpu"), host_visible=False,
                                 mask_policy=MaskPolicy.CAPACITY)
    monkeypatch.setattr(facade, "resolve_device", lambda *args: device)
    with load(folder, provider="cpu", chunk_size=W, max_batch=2) as on_device:
        with on_device.open_sequence() as sequence:
            assert all(buffer.host is None for buffer in sequence.buffers.kv)
        assert _alone(on_device, prompts) == expected
