"""RuntimeOptions (the user's options, checked when made) and resolve_options (what a runtime runs
with, from those options, the plan, genai config, ports and device), tested without ONNX Runtime
(the plan comes from the passes, the ports from the file)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from onnx_chunk.errors import ConfigError, ModelLoadError, ProviderError
from onnx_chunk.graph.model_file import read_model_file
from onnx_chunk.graph.model_folder import GenaiConfig
from onnx_chunk.graph.model_io import load_model
from onnx_chunk.ladder import ladder_tiers
from onnx_chunk.passes import analyze
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for
from onnx_chunk.runtime.options import (
    RuntimeOptions,
    resolve_capacity,
    resolve_chunk_size,
    resolve_options,
)
from onnx_chunk.runtime.runner.padding import PADDING_ENV_VARS


@pytest.fixture(scope="module")
def decoder(reference_model):
    """The `tiny` reference decoder's file, its plan at chunk 32, and a genai config without
    limits."""
    path = reference_model()
    return (read_model_file(path), analyze(load_model(path), chunk_size=32),
            GenaiConfig(path=path.parent / "genai_config.json"))


def _resolve(decoder, resolved=None, **arguments):
    """The options of `decoder` on `resolved` (the device `resolve_device` gave), else on the
    `device` argument, else on CPU."""
    model, plan, genai = decoder
    options = RuntimeOptions(**arguments)
    return resolve_options(options, plan=plan, genai=genai, model=model,
                           device=resolved or options.device or device_for("cpu"))


def test_capacity_defaults_to_the_tightest_limit_and_refuses_more(decoder):
    _, plan, genai = decoder
    limited = dataclasses.replace(genai, context_length=100)
    assert resolve_capacity(None, plan, genai) == plan.max_sequence_length
    assert resolve_capacity(None, plan, limited) == 100
    assert resolve_capacity(None, plan, dataclasses.replace(limited, max_length=60)) == 60
    with pytest.raises(ConfigError, match="capacity 101 exceeds the model.context_length 100"):
        resolve_capacity(101, plan, limited)
    with pytest.raises(ConfigError, match="search.max_length gives a capacity of 1"):
        resolve_capacity(None, plan, dataclasses.replace(genai, max_length=1))
    blind = dataclasses.replace(plan, max_sequence_length=None)
    with pytest.raises(ConfigError, match="declares no maximum sequence length"):
        resolve_capacity(None, blind, genai)


def test_chunk_size_is_the_argument_the_plan_or_the_capacity(decoder):
    _, plan, _ = decoder
    assert resolve_chunk_size(None, plan, 128) == 32
    assert resolve_chunk_size(500, plan, 128) == 128
    assert resolve_chunk_size(None, dataclasses.replace(plan, chunk_size=None), 128) == 128


def test_the_plan_ladder_is_kept_only_for_its_own_chunk_size(decoder):
    _, plan, _ = decoder
    assert _resolve(decoder, capacity=128).tiers == plan.ladder
    assert _resolve(decoder, capacity=128, chunk_size=24).tiers == ladder_tiers(
        24, plan.max_variants)
    assert _resolve(decoder, capacity=128, max_variants=2).tiers == ladder_tiers(32, 2)


def test_specialize_and_padding_follow_the_device_default(decoder, monkeypatch):
    for name in PADDING_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    generic = _resolve(decoder, capacity=128)
    assert generic.specialize is False and generic.padding is False
    assert generic.padding_refused is not None and not generic.select_rows
    per_width = _resolve(decoder, capacity=128, specialize=True)
    assert per_width.padding and per_width.padding_refused is None
    hidden = dataclasses.replace(device_for("cpu"), host_visible=False)
    assert _resolve(decoder, hidden, capacity=128, specialize=True).select_rows
    with pytest.raises(ConfigError, match="specialize must be True, False or 'exact'"):
        _resolve(decoder, capacity=128, specialize="always")


def test_fixed_dims_follow_the_mask_policy_and_the_slots(decoder):
    one = _resolve(decoder, capacity=128)
    wide = _resolve(decoder, device_for("cpu", mask_policy=MaskPolicy.CAPACITY), capacity=128)
    batch, mask = one.ports.batch_dim, one.ports.mask_dim
    assert one.fixed_dims[batch] == 1 and mask not in one.fixed_dims
    assert wide.fixed_dims[mask] == 128
    assert batch not in _resolve(decoder, capacity=128, max_batch=4).fixed_dims


def test_a_float32_cache_on_cuda_falls_back_or_is_refused(decoder):
    cuda = device_for("cuda")
    assert _resolve(decoder, cuda, capacity=128, provider="auto").device.provider == "cpu"
    with pytest.raises(ProviderError, match="GroupQueryAttention runs float16 and bfloat16"):
        _resolve(decoder, cuda, capacity=128, provider="cuda")
    with pytest.raises(ProviderError, match="use --provider cpu"):
        _resolve(decoder, capacity=128, device=cuda)


def test_more_than_one_slot_keeps_cuda_graphs_on(decoder):
    # The batched decode is a binding of the one runner: it captures like any other.
    graphs = dataclasses.replace(device_for("cpu"), cuda_graphs=True)
    assert _resolve(decoder, capacity=128, device=graphs).device.cuda_graphs
    assert _resolve(decoder, capacity=128, device=graphs, max_batch=2).device.cuda_graphs


def test_eos_ids_outside_the_vocabulary_are_refused(decoder):
    model, plan, genai = decoder
    vocab = _resolve(decoder, capacity=128).ports.vocab_size
    with pytest.raises(ModelLoadError, match=rf"EOS token id\(s\) \[{vocab}\] outside"):
        resolve_options(RuntimeOptions(capacity=128), plan=plan, model=model,
                        genai=dataclasses.replace(genai, eos_token_ids=(vocab,)),
                        device=device_for("cpu"))


@pytest.mark.parametrize(("arguments", "needle"), [
    ({"capacity": 1}, "at least 2"),
    ({"chunk_size": 2.0}, "must be an integer"),
    ({"padding": 1}, "padding must be True, False or None"),
    ({"cuda_graphs": "yes"}, "cuda_graphs must be True"),
    ({"max_batch": 0}, "max_batch must be at least 1"),
    ({"idle_sequences": -1}, "idle_sequences must be at least 0"),
    ({"max_queue": True}, "max_queue must be an integer"),
])
def test_options_of_the_wrong_type_or_range_are_refused_when_made(arguments, needle):
    with pytest.raises(ConfigError, match=needle):
        RuntimeOptions(**arguments)


def test_counts_given_as_numpy_integers_are_kept_as_ints():
    options = RuntimeOptions(max_batch=np.int64(3), max_queue=np.int32(5))
    assert type(options.max_batch) is int and type(options.max_queue) is int
    assert (options.max_batch, options.max_queue) == (3, 5)
