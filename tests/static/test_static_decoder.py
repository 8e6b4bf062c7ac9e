"""The static reference decoder: fixed shapes, the dynamic model's weights, NumPy agreement."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnx_chunk.errors import ConfigError
from onnx_chunk.models.config import config_for
from onnx_chunk.models.static_decoder import build_static_decoder, reference_forward
from onnx_chunk.models.weights import make_weights
from onnx_chunk.static.mask import chunk_mask, mask_fill_value

from .static_sizes import CAPACITY, CHUNK, CPU, SEED


@pytest.fixture(scope="module")
def chunk_model(static_models):
    return static_models(CHUNK, CAPACITY, SEED)


def _feeds(config, input_ids, position_ids, mask, keys, values):
    feeds = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": mask}
    for layer in range(config.num_layers):
        feeds[f"past_key_values.{layer}.key"] = keys[layer]
        feeds[f"past_key_values.{layer}.value"] = values[layer]
    return feeds


def test_every_dimension_is_fixed_and_sizes_are_recorded(chunk_model):
    model = onnx.load(chunk_model, load_external_data=False)
    config = config_for("tiny")
    shapes = {value.name: [dim.dim_value if dim.HasField("dim_value") else dim.dim_param
                           for dim in value.type.tensor_type.shape.dim]
              for value in list(model.graph.input) + list(model.graph.output)}
    assert all(isinstance(dim, int) and dim > 0 for shape in shapes.values() for dim in shape)
    assert shapes["input_ids"] == shapes["position_ids"] == [1, CHUNK]
    assert shapes["attention_mask"] == [1, 1, CHUNK, CAPACITY]
    assert shapes["logits"] == [1, CHUNK, config.vocab_size]
    for layer in range(config.num_layers):
        assert shapes[f"past_key_values.{layer}.value"] == [1, 2, CAPACITY, 16]
        assert shapes[f"present.{layer}.key"] == [1, 2, CHUNK, 16]
    metadata = {prop.key: prop.value for prop in model.metadata_props}
    assert metadata["onnx_chunk.static.chunk_size"] == str(CHUNK)
    assert metadata["onnx_chunk.static.capacity"] == str(CAPACITY)


def test_weights_are_the_dynamic_models_weights(chunk_model, dynamic_models):
    static = {t.name: t for t in onnx.load(chunk_model).graph.initializer}
    dynamic = onnx.load(dynamic_models(SEED)).graph.initializer
    weights = make_weights(config_for("tiny"), SEED)
    np.testing.assert_array_equal(numpy_helper.to_array(static["embed_tokens.weight"]),
                                  weights.embedding)
    np.testing.assert_array_equal(numpy_helper.to_array(static["lm_head.weight"]),
                                  weights.lm_head)
    dynamic_arrays = [numpy_helper.to_array(t) for t in dynamic]
    assert any(a.shape == weights.embedding.shape and np.array_equal(a, weights.embedding)
               for a in dynamic_arrays)


def test_onnx_runtime_agrees_with_the_numpy_reference(chunk_model):
    config = config_for("tiny")
    weights = make_weights(config, SEED)
    session = ort.InferenceSession(str(chunk_model), providers=CPU)
    rng = np.random.default_rng(7)
    shape = (1, config.num_kv_heads, CAPACITY, config.head_size)
    keys = [rng.standard_normal(shape).astype(np.float32) for _ in range(config.num_layers)]
    values = [rng.standard_normal(shape).astype(np.float32) for _ in range(config.num_layers)]
    valid = np.array([False] * 5 + [True] * 15)
    input_ids = rng.integers(0, config.vocab_size, (1, CHUNK))
    position_ids = np.arange(12, 12 + CHUNK)[None]
    mask = chunk_mask(valid, 16, CHUNK, CAPACITY)
    outputs = session.run(None, _feeds(config, input_ids, position_ids, mask, keys, values))
    logits, new_keys, new_values = reference_forward(config, weights, input_ids, position_ids,
                                                     mask, keys, values)
    np.testing.assert_allclose(outputs[0], logits, atol=2e-5, rtol=1e-4)
    for layer in range(config.num_layers):
        np.testing.assert_allclose(outputs[1 + 2 * layer], new_keys[layer], atol=1e-5)
        np.testing.assert_allclose(outputs[2 + 2 * layer], new_values[layer], atol=1e-5)


def test_a_padding_only_chunk_is_finite_with_the_fill_value_and_nan_with_minus_infinity(
        chunk_model):
    config = config_for("tiny")
    session = ort.InferenceSession(str(chunk_model), providers=CPU)
    zeros = [np.zeros((1, 2, CAPACITY, 16), np.float32)] * config.num_layers
    mask = chunk_mask(np.array([False] * 3 + [True]), 0, CHUNK, CAPACITY)
    input_ids = np.array([[0, 0, 0, 17]])
    positions = np.zeros((1, CHUNK), np.int64)
    finite = session.run(["logits"], _feeds(config, input_ids, positions, mask, zeros, zeros))[0]
    assert np.isfinite(finite).all()
    infinite_mask = np.where(mask == mask_fill_value(np.float32), -np.inf, 0).astype(np.float32)
    infinite = session.run(["logits"],
                           _feeds(config, input_ids, positions, infinite_mask, zeros, zeros))[0]
    assert np.isnan(infinite[0, :3]).all()
    # the padding rows' NaN hidden states become the next layer's padding K/V, and a zero
    # weight times NaN is NaN: the real row is lost too
    assert np.isnan(infinite[0, 3]).all()


def test_conv_layers_and_impossible_shapes_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="attention layers only"):
        build_static_decoder(tmp_path, chunk_size=4, capacity=8, conv_layers=(0,))
    with pytest.raises(ConfigError, match="c <= C"):
        build_static_decoder(tmp_path, chunk_size=16, capacity=8)
    assert not any(tmp_path.iterdir())
