"""A Runtime's public names are what users call (docs/runtime.md, "API"); its parts
are private, and `runtime.debug` is the one view of them, for tests and diagnosis."""

import dataclasses

import pytest

import onnx_chunk
from onnx_chunk.runtime import Runtime, RuntimeOptions, load
from onnx_chunk.runtime.facade import RuntimeDebug

PUBLIC = {"submit", "submit_choices", "generate_many", "open_sequence", "model_path", "genai",
          "stats", "debug", "close", "closed", "step", "check_request"}
PARTS = {"model_path", "genai", "plan", "options", "ports", "device", "weights", "factory",
         "variants", "cache", "masks", "pool", "runner", "embeddings", "engine"}


def _public(names) -> set[str]:
    return {name for name in names if not name.startswith("_")}


def test_the_runtime_names_only_what_users_call(reference_model):
    assert _public(dir(Runtime)) == PUBLIC
    runtime = load(reference_model(), provider="cpu", capacity=64, chunk_size=16)
    runtime.submit([1, 2, 3], 2).result()
    assert _public(dir(runtime)) == PUBLIC
    assert _public(vars(runtime)) <= PUBLIC
    assert load is Runtime and onnx_chunk.load is Runtime


def test_the_debug_view_names_every_part(reference_model):
    runtime = load(reference_model(), provider="cpu", capacity=64, chunk_size=16)
    assert {field.name for field in dataclasses.fields(RuntimeDebug)} == PARTS
    debug = runtime.debug
    assert debug.engine is None  # made by the first submit
    runtime.submit([1, 2, 3], 2).result()
    assert runtime.debug.engine is not None
    assert debug.ports.vocab_size == runtime.stats.vocab_size
    assert debug.options.capacity == runtime.stats.capacity == 64


def test_runtime_options_are_the_users_options_only():
    # What load takes, and nothing the runtime resolves (those live in debug.options).
    assert {field.name for field in dataclasses.fields(RuntimeOptions)} == {
        "provider", "device_id", "capacity", "chunk_size", "padding", "specialize",
        "max_variants", "mask_policy", "intra_op_threads", "cuda_graphs", "device",
        "idle_sequences", "max_batch", "max_queue", "prefix_reuse", "speculative", "exact"}
    assert RuntimeOptions().capacity is None
    # The package exports it beside `load`: `onnx_chunk.load(path, onnx_chunk.RuntimeOptions())`.
    import onnx_chunk

    assert onnx_chunk.RuntimeOptions is RuntimeOptions and "RuntimeOptions" in onnx_chunk.__all__


def test_load_takes_one_runtime_options_or_its_fields_as_keywords(reference_model):
    from onnx_chunk.errors import ConfigError

    path = reference_model()
    given = load(path, RuntimeOptions(provider="cpu", capacity=64, chunk_size=16))
    keywords = load(path, provider="cpu", capacity=64, chunk_size=16)
    assert given.debug.options == keywords.debug.options
    assert given.stats.capacity == 64 and given.stats.chunk_size == 16
    with pytest.raises(ConfigError, match="unknown option max_batches"):
        load(path, provider="cpu", max_batches=2)
    with pytest.raises(ConfigError, match="not both .*capacity"):
        load(path, RuntimeOptions(provider="cpu"), capacity=64)
    with pytest.raises(ConfigError, match="must be a RuntimeOptions, got dict"):
        load(path, {"capacity": 64})
