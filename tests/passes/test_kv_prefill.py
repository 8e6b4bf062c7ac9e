"""KVPrefillPass and `convert --kv-prefill`: forwards of MIN_ROWS rows or more over a quantized
KV cache attend in float32 over the dequantized cache, on every GroupQueryAttention export of
the corpus, with the cache bytes and (within float rounding) the logits of ONNX Runtime's
quantized kernel."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from onnx_chunk import Sampling
from onnx_chunk.calibration import BUILTIN_PROMPTS, calibrate_kv
from onnx_chunk.cli import main
from onnx_chunk.errors import ConfigError
from onnx_chunk.graph import metadata
from onnx_chunk.graph.model_io import load_model, save_model
from onnx_chunk.passes import KVPrefillPass, analyze, convert_model, prefill_mode
from onnx_chunk.passes.kv_prefill import MIN_ROWS, unwrap, wrappers
from onnx_chunk.passes.value_tracing import gqa_nodes
from onnx_chunk.runtime import load
from tests.cli_output import one_error_line
from tests.exports.corpus import builder_gqa_fixtures

FIXTURES = builder_gqa_fixtures()
LLAMA = next(fixture for fixture in FIXTURES if fixture.name == "genai-llama-fp32")
CASES = [pytest.param(fixture, kv_dtype, kv_scales, id=f"{fixture}-{kv_dtype}-{kv_scales}")
         for fixture in FIXTURES for kv_dtype in ("int8", "int4")
         for kv_scales in ("per-channel", "per-tensor")
         if not (kv_dtype == "int4" and fixture.features.get("sliding_window"))]
# A prefill of 100 tokens in chunks of 64: a 64-row forward and a 36-row one (both take the
# float branch, at least MIN_ROWS rows), then decode steps (the kernel).
W, PROMPT, NEW = 64, 100, 6
# What float32 attention over the dequantized values may move the logits by against the
# kernel's own sums when every code is the kernel's (measured on the corpus: under 1e-5).
LOGITS_ATOL = 1e-4
# With a code one step away, or INT4 weights (MatMulNBits at accuracy level 4 rounds each
# activation row to int8, so a last-ulp difference can move an output by a whole step), the
# bound static.chunked_vs_whole takes for such graphs (docs/static_graph.md; measured here:
# up to 0.098).
INT4_LOGITS_ATOL = 0.25


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(fixture, kv_dtype, kv_scales) converted with each prefill, on one calibration."""
    made: dict[tuple, dict[str, ir.Model]] = {}
    calibrations: dict[str, object] = {}

    def models(fixture, kv_dtype: str, kv_scales: str) -> dict[str, object]:
        key = (fixture.name, kv_dtype, kv_scales)
        if key not in made:
            if fixture.name not in calibrations:
                calibrations[fixture.name] = calibrate_kv(fixture.folder, BUILTIN_PROMPTS[:2])
            made[key] = {}
            for mode in ("kernel", "dequantized"):
                model = convert_model(load_model(fixture.folder / "model.onnx"), chunk_size=W,
                                      kv_dtype=kv_dtype, kv_scales=kv_scales,
                                      calibration=calibrations[fixture.name],
                                      kv_prefill=mode).model
                target = tmp_path_factory.mktemp(f"{fixture.name}-{mode}") / "model.onnx"
                save_model(model, target, companions_from=fixture.folder)
                made[key][mode] = target.parent
        return made[key]

    return models


def _run(folder, prompt: list[int]) -> tuple[np.ndarray, list[np.ndarray], list[int]]:
    """The prompt's logits (every row), the KV rows it wrote, and NEW greedy tokens."""
    with load(folder, provider="cpu", chunk_size=W) as runtime:
        with runtime.open_sequence() as sequence:
            logits = sequence.prefill(prompt, all_logits=True)
            cache = [buffer.host[:, :, :len(prompt)].copy() for buffer in sequence.buffers.kv]
        with runtime.open_sequence() as sequence:
            tokens = sequence.generate(prompt, NEW, eos_token_id=[])
    return logits, cache, tokens


@pytest.mark.parametrize(("fixture", "kv_dtype", "kv_scales"), CASES)
def test_a_prefill_attends_in_float_with_the_kernels_cache_bytes(fixture, kv_dtype, kv_scales,
                                                                  converted, capsys):
    folders = converted(fixture, kv_dtype, kv_scales)
    with load(folders["kernel"], provider="cpu") as runtime:
        vocab = runtime.stats.vocab_size
    prompt = np.random.default_rng(5).integers(3, vocab, PROMPT).tolist()
    kernel_logits, kernel_cache, kernel_tokens = _run(folders["kernel"], prompt)
    logits, cache, tokens = _run(folders["dequantized"], prompt)
    # Rule 3: the first layer's new rows (whose inputs both graphs compute alike) are
    # quantized and written where the kernel writes them, byte for byte: positions, rounding,
    # int4 packing.
    first = [index for index, name in enumerate(_cache_names(folders["kernel"]))
             if name in _first_layer(folders["kernel"])]
    assert first
    for index in first:
        np.testing.assert_array_equal(cache[index], kernel_cache[index])
    # Deeper layers read attention outputs summed in another order (within 1e-6): a value at
    # a rounding boundary may land one code away.
    steps = [np.abs(_codes(ours) - _codes(theirs)) for ours, theirs in zip(cache, kernel_cache)]
    moved = sum(int((step > 0).sum()) for step in steps) / sum(step.size for step in steps)
    assert max(int(step.max()) for step in steps) <= 1 and moved < 0.01
    drift = float(np.abs(logits - kernel_logits).max())
    spread = float(kernel_logits.max() - kernel_logits.min())
    exact = moved == 0 and fixture.precision == "fp32"
    assert drift < (LOGITS_ATOL if exact else INT4_LOGITS_ATOL)
    with capsys.disabled():
        print(f"\n{fixture} {kv_dtype} {kv_scales}: codes moved {moved:.4%}, logits "
              f"{drift:.2e} ({drift / spread:.2e} of their spread), greedy tokens "
              f"{'equal' if tokens == kernel_tokens else f'{tokens} vs {kernel_tokens}'}")


def _codes(stored: np.ndarray) -> np.ndarray:
    """int8 codes, or the two 4-bit codes of each uint8 byte, as int16."""
    if stored.dtype == np.int8:
        return stored.astype(np.int16)
    return np.stack([stored & 0x0F, stored >> 4], axis=-1).astype(np.int16)


def _cache_names(folder) -> list[str]:
    return [binding.input for binding in
            metadata.read_plan(load_model(folder / "model.onnx")).capacity_inputs]


def _first_layer(folder) -> set[str]:
    node = gqa_nodes(load_model(folder / "model.onnx").graph)[0]
    return {node.inputs[3].name, node.inputs[4].name}


@pytest.mark.parametrize("fixture", FIXTURES, ids=str)
def test_every_quantized_gqa_is_wrapped_and_the_pass_undoes_itself(fixture, converted):
    folders = converted(fixture, "int8", "per-channel")
    kernel = load_model(folders["kernel"] / "model.onnx")
    model = load_model(folders["dequantized"] / "model.onnx")
    nodes = gqa_nodes(model.graph)
    window = [node for node in nodes if node.attributes.get("sliding_window_cache") is not None
              and node.attributes["sliding_window_cache"].as_int() == 1]
    # Rules 2 and 4: every node in an If of its own, but a window-sized cache's.
    assert len(wrappers(model.graph)) == len(nodes) - len(window)
    assert all(node.graph is model.graph for node in window)
    assert len(nodes) == len(gqa_nodes(kernel.graph)) == metadata.read_plan(model).gqa_nodes
    assert prefill_mode(model) == ("dequantized" if len(window) < len(nodes) else "kernel")
    # The passes read the kernel-only graph: analysing the wrapped model plans what it declares.
    assert analyze(model) == metadata.read_plan(model)
    # Rule 5: again changes nothing; converting again keeps the prefill it has.
    assert not KVPrefillPass("dequantized")(model).modified
    assert not convert_model(model, chunk_size=W).modified
    # Rule 1: undone, the graph is the kernel conversion's.
    assert KVPrefillPass("kernel")(model).modified == bool(wrappers(kernel.graph) or
                                                           len(window) < len(nodes))
    assert not unwrap(model)
    theirs = ir.serde.serialize_model(kernel).graph
    ours = ir.serde.serialize_model(model).graph
    assert [(node.op_type, node.name, list(node.input), list(node.output))
            for node in ours.node] == [(node.op_type, node.name, list(node.input),
                                        list(node.output)) for node in theirs.node]
    assert sorted(value.name for value in ours.initializer) == sorted(
        value.name for value in theirs.initializer)


def test_the_float_branch_takes_every_forward_of_several_rows():
    """MIN_ROWS is the If's threshold: a decode step (one row) runs the kernel, every prompt
    forward and speculative verification the float branch."""
    assert MIN_ROWS == 2
    model = convert_model(load_model(LLAMA.folder / "model.onnx"), kv_dtype="int8",
                          calibration=calibrate_kv(LLAMA.folder, BUILTIN_PROMPTS[:1])).model
    for wrapper in wrappers(model.graph):
        condition = wrapper.inputs[0].producer()
        threshold = condition.inputs[0].producer().inputs[1].producer()
        assert threshold.attributes["value"].as_tensor().numpy().tolist() == [MIN_ROWS]


# A prompt of 70 tokens whole, and in chunks whose last one is shorter than the float branch's
# old threshold of 32 rows (70 = 64 + 6 = 31 + 31 + 8 = 24 + 24 + 22 = 7 x 10). No forward is
# k x 32 + 1 rows wide: llama's head size is 16, and ONNX Runtime's float attention leaves the
# last row of such a forward alone in its block of 2 x 16 rows (docs/row_grouping.md; exact
# mode pads those, tested below).
CHUNKED, CHUNK_WIDTHS = 70, (64, 31, 24, 10)


def _prefilled(folder, prompt, chunk: int, **options) -> tuple[np.ndarray, list[np.ndarray]]:
    """Every prompt row's logits and the KV rows the prompt wrote, prefilled in `chunk`s."""
    with load(folder, provider="cpu", chunk_size=chunk, **options) as runtime:
        with runtime.open_sequence() as sequence:
            logits = sequence.prefill(prompt, all_logits=True)
            return logits, [buffer.host[:, :, :len(prompt)].copy()
                            for buffer in sequence.buffers.kv]


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_a_prompt_in_chunks_gives_the_whole_prefills_numbers(kv_dtype, converted):
    """Every prompt forward attends in the float branch, so how the prompt is cut changes no
    code of the cache and no bit of the logits (docs/row_grouping.md)."""
    folder = converted(LLAMA, kv_dtype, "per-channel")["dequantized"]
    prompt = np.random.default_rng(7).integers(3, 384, CHUNKED).tolist()
    whole_logits, whole_cache = _prefilled(folder, prompt, CHUNKED)
    for chunk in CHUNK_WIDTHS:
        logits, cache = _prefilled(folder, prompt, chunk)
        np.testing.assert_array_equal(logits, whole_logits, err_msg=f"chunks of {chunk}")
        for ours, whole in zip(cache, whole_cache, strict=True):
            np.testing.assert_array_equal(ours, whole, err_msg=f"chunks of {chunk}")


def test_exact_mode_holds_over_an_int8_cache(converted):
    """Exact mode pads an odd forward to an even width, so a one-row remainder (a decode step's
    kernel otherwise) and a row alone in its block also give the whole prefill's numbers; a
    slot reused for a follow-up gives the fresh prefill's tokens and logprobs."""
    folder = converted(LLAMA, "int8", "per-channel")["dequantized"]
    prompt = np.random.default_rng(8).integers(3, 384, CHUNKED - 1).tolist()
    whole_logits, whole_cache = _prefilled(folder, prompt, CHUNKED, exact=True)
    for chunk in (34, 32, 17, 4):  # 69 = 34 + 34 + 1 = 32 + 32 + 5 = 17 x 4 + 1 = 4 x 17 + 1
        logits, cache = _prefilled(folder, prompt, chunk, exact=True)
        np.testing.assert_array_equal(logits, whole_logits, err_msg=f"chunks of {chunk}")
        for ours, whole in zip(cache, whole_cache, strict=True):
            np.testing.assert_array_equal(ours, whole, err_msg=f"chunks of {chunk}")
    sampling = Sampling(logprobs=1)
    answers = {}
    for reuse in (False, True):
        with load(folder, provider="cpu", chunk_size=16, max_batch=2, prefix_reuse=reuse,
                  exact=True) as runtime:
            first = runtime.submit(prompt[:20], 6, eos_token_id=[], sampling=sampling)
            follow = prompt[:20] + first.result(timeout=60) + prompt[20:30]
            request = runtime.submit(follow, 6, eos_token_id=[], sampling=sampling)
            answers[reuse] = (request.result(timeout=60),
                              [step.logprob for step in request.logprobs])
            assert (runtime.stats.engine.prefix_reused_tokens > 0) == reuse
    assert answers[True] == answers[False]


def test_cli_chooses_the_prefill_and_refuses_it_for_a_float_cache(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(LLAMA.folder), "-o", str(out), "--kv-prefill", "kernel"]) == 2
    one_error_line(capsys, "--kv-prefill applies to a quantized KV cache only")
    assert not out.exists()
    assert main(["convert", str(LLAMA.folder), "-o", str(out), "--kv-dtype", "int8"]) == 0
    assert prefill_mode(load_model(out / "model.onnx")) == "dequantized"
    capsys.readouterr()
    assert main(["convert", str(out), "--in-place", "--kv-prefill", "kernel"]) == 0
    assert prefill_mode(load_model(out / "model.onnx")) == "kernel"
    assert main(["convert", str(out), "--in-place", "--kv-prefill", "kernel"]) == 0
    assert "already converted with these settings" in capsys.readouterr().out
    # Without --kv-prefill a conversion keeps the prefill the model has.
    assert main(["convert", str(out), "--in-place", "--chunk-size", "32"]) == 0
    assert prefill_mode(load_model(out / "model.onnx")) == "kernel"
    with pytest.raises(ConfigError, match="unknown KV prefill 'fast'"):
        KVPrefillPass("fast")
