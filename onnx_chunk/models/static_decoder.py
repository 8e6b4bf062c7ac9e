"""The static reference decoder: every dimension fixed, explicit attention over a rolling cache.

The contract of an edge accelerator that runs fixed shapes only, built from the same seeded
weights as the dynamic GQA reference decoder (`make_weights`), so both agree token for token on
prompts that fit.

Graph contract (rows c = `chunk_size`, capacity C, all dims fixed, no dim_params):
- inputs `input_ids` int64 [1, c], `position_ids` int64 [1, c], `attention_mask` float32
  [1, 1, c, C] (additive: 0 open, a large finite negative masked), and per layer
  `past_key_values.%d.key|value` float32 [1, kv_heads, C, head_size];
- outputs `logits` float32 [1, c, vocab] and per layer `present.%d.key|value` float32
  [1, kv_heads, c, head_size]: only the chunk's new (rotated) K/V;
- attention: keys = concat(past, new)[:, :, c:], the cache after this chunk was rolled in on the
  right, so the mask's key axis is that rolled cache; softmax(q k^T / sqrt(d) + mask) v with
  kv heads repeated to the query heads;
- rotary: non-interleaved halves with cos/sin gathered from [max_positions, head_size / 2]
  caches at `position_ids`, as GroupQueryAttention does with do_rotary=1, rotary_interleaved=0.

`reference_forward` is the same computation in NumPy, with a key axis of any length, so a test
can also run a whole sequence at once under any mask.
"""

from __future__ import annotations

import filecmp
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_chunk.errors import ConfigError, OutputError
from onnx_chunk.models.config import DecoderConfig, config_for
from onnx_chunk.models.decoder_graph import rotary_caches
from onnx_chunk.models.weights import AttentionWeights, DecoderWeights, make_weights
from onnx_chunk.staged_output import Staging, staged_write
from onnx_chunk.static.graphs import METADATA_PREFIX
from onnx_chunk.static.loading import DECODE_FILE

logger = logging.getLogger(__name__)

STATIC_OPSET = 18
STATIC_IR_VERSION = 10  # what ONNX Runtime 1.22+ loads
MODEL_FILE = "model.onnx"


@dataclass(frozen=True)
class StaticShape:
    """The fixed sizes of one static graph: query rows c and KV capacity C."""

    chunk_size: int
    capacity: int

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.capacity < 1:
            raise ConfigError(
                f"chunk size and capacity must be at least 1, got c={self.chunk_size}, "
                f"C={self.capacity}"
            )
        if self.chunk_size > self.capacity:
            raise ConfigError(
                f"chunk size c={self.chunk_size} exceeds the KV capacity C={self.capacity}; "
                "use c <= C"
            )


def _static_config(config: DecoderConfig) -> DecoderConfig:
    if config.conv_layers:
        raise ConfigError(
            f"the static reference decoder has attention layers only, got conv_layers "
            f"{config.conv_layers}; build it without conv layers"
        )
    return config.validate()


# ---------------------------------------------------------------------------------------------
# NumPy reference


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * weight


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _softmax(x: np.ndarray) -> np.ndarray:
    shifted = np.exp(x - x.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def reference_forward(
    config: DecoderConfig,
    weights: DecoderWeights,
    input_ids: np.ndarray,
    position_ids: np.ndarray,
    attention_mask: np.ndarray,
    past_keys: list[np.ndarray],
    past_values: list[np.ndarray],
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """The static decoder's forward in NumPy: (logits, new keys, new values).

    Shapes as in the graph contract, except that the key axis may have any length K <= past + r:
    keys are concat(past, new)[:, :, -K:] with K = attention_mask.shape[-1]. With empty past
    ([1, kv_heads, 0, head_size]) and an r x r mask this is a whole-sequence forward.
    """
    config = _static_config(config)
    rows = input_ids.shape[1]
    group = config.num_heads // config.num_kv_heads
    key_len = attention_mask.shape[-1]
    cos_cache, sin_cache = rotary_caches(config)
    cos = cos_cache[position_ids][:, None]  # [1, 1, r, d/2]
    sin = sin_cache[position_ids][:, None]
    scale = np.float32(1.0 / np.sqrt(config.head_size))
    hidden = weights.embedding[input_ids]
    new_keys, new_values = [], []
    for layer, layer_weights in enumerate(weights.layers):
        mixer = layer_weights.mixer
        assert isinstance(mixer, AttentionWeights)
        normed = _rms_norm(hidden, layer_weights.input_norm, config.rms_norm_eps)

        def heads(x: np.ndarray, count: int) -> np.ndarray:
            return x.reshape(1, rows, count, config.head_size).transpose(0, 2, 1, 3)

        query = _rotate(heads(normed @ mixer.q_proj, config.num_heads), cos, sin)
        key = _rotate(heads(normed @ mixer.k_proj, config.num_kv_heads), cos, sin)
        value = heads(normed @ mixer.v_proj, config.num_kv_heads)
        new_keys.append(key)
        new_values.append(value)
        all_keys = np.concatenate([past_keys[layer], key], axis=2)[:, :, -key_len:]
        all_values = np.concatenate([past_values[layer], value], axis=2)[:, :, -key_len:]
        all_keys = np.repeat(all_keys, group, axis=1)
        all_values = np.repeat(all_values, group, axis=1)
        scores = query @ all_keys.transpose(0, 1, 3, 2) * scale + attention_mask
        attended = (_softmax(scores) @ all_values).transpose(0, 2, 1, 3).reshape(1, rows, -1)
        hidden = hidden + attended @ mixer.o_proj
        normed = _rms_norm(hidden, layer_weights.post_norm, config.rms_norm_eps)
        gate = normed @ layer_weights.gate_proj
        mlp = (gate / (1.0 + np.exp(-gate)) * (normed @ layer_weights.up_proj))
        hidden = hidden + mlp @ layer_weights.down_proj
    logits = _rms_norm(hidden, weights.final_norm, config.rms_norm_eps) @ weights.lm_head
    return logits.astype(np.float32), new_keys, new_values


# ---------------------------------------------------------------------------------------------
# ONNX graph


class _GraphBuilder:
    """Collects nodes and initializers with unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def constant(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type: str, inputs: list[str], **attributes) -> str:
        self._count += 1
        output = f"/{op_type.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op_type, inputs, [output],
                                           name=f"{op_type}_{self._count}", **attributes))
        return output

    def ops(self, op_type: str, inputs: list[str], outputs: int, **attributes) -> list[str]:
        self._count += 1
        names = [f"/{op_type.lower()}_{self._count}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names,
                                           name=f"{op_type}_{self._count}", **attributes))
        return names

    def rename(self, value: str, name: str) -> None:
        self.nodes.append(helper.make_node("Identity", [value], [name], name=f"out_{name}"))


def _rms_norm_nodes(graph: _GraphBuilder, x: str, weight: str, eps: str, axes: str) -> str:
    mean = graph.op("ReduceMean", [graph.op("Mul", [x, x]), axes], keepdims=1)
    return graph.op("Mul", [graph.op("Div", [x, graph.op("Sqrt", [graph.op("Add", [mean, eps])])]),
                            weight])


def _rotary_nodes(graph: _GraphBuilder, x: str, cos: str, sin: str, split: str) -> str:
    x1, x2 = graph.ops("Split", [x, split], 2, axis=-1)
    first = graph.op("Sub", [graph.op("Mul", [x1, cos]), graph.op("Mul", [x2, sin])])
    second = graph.op("Add", [graph.op("Mul", [x2, cos]), graph.op("Mul", [x1, sin])])
    return graph.op("Concat", [first, second], axis=-1)


def _static_graph(
    config: DecoderConfig, weights: DecoderWeights, shape: StaticShape
) -> onnx.GraphProto:
    rows, cap = shape.chunk_size, shape.capacity
    heads, kv_heads, head_size = config.num_heads, config.num_kv_heads, config.head_size
    group = heads // kv_heads
    graph = _GraphBuilder()
    cos_cache, sin_cache = rotary_caches(config)
    c = graph.constant
    eps = c("rms_eps", np.array(config.rms_norm_eps, dtype=np.float32))
    last_axis = c("axis_last", np.array([-1], dtype=np.int64))
    scale = c("attention_scale", np.array(1.0 / np.sqrt(head_size), dtype=np.float32))
    split = c("rotary_split", np.array([head_size // 2, head_size // 2], dtype=np.int64))
    q_shape = c("shape_q", np.array([1, rows, heads, head_size], dtype=np.int64))
    kv_shape = c("shape_kv", np.array([1, rows, kv_heads, head_size], dtype=np.int64))
    expanded = c("shape_kv_expanded", np.array([1, kv_heads, group, cap, head_size],
                                               dtype=np.int64))
    repeated = c("shape_kv_repeated", np.array([1, heads, cap, head_size], dtype=np.int64))
    merged = c("shape_merged", np.array([1, rows, heads * head_size], dtype=np.int64))
    window = (c("window_start", np.array([rows], dtype=np.int64)),
              c("window_end", np.array([rows + cap], dtype=np.int64)),
              c("window_axis", np.array([2], dtype=np.int64)))
    axis_heads = c("axis_heads", np.array([1], dtype=np.int64))
    axis_group = c("axis_group", np.array([2], dtype=np.int64))

    cos = graph.op("Unsqueeze", [graph.op("Gather", [c("cos_cache", cos_cache), "position_ids"]),
                                 axis_heads])
    sin = graph.op("Unsqueeze", [graph.op("Gather", [c("sin_cache", sin_cache), "position_ids"]),
                                 axis_heads])
    hidden = graph.op("Gather", [c("embed_tokens.weight", weights.embedding), "input_ids"])
    for layer, layer_weights in enumerate(weights.layers):
        mixer = layer_weights.mixer
        assert isinstance(mixer, AttentionWeights)
        prefix = f"layers.{layer}."
        normed = _rms_norm_nodes(graph, hidden, c(prefix + "input_norm.weight",
                                                  layer_weights.input_norm), eps, last_axis)

        def project(name: str, weight: np.ndarray, shape_name: str, normed: str = normed,
                    prefix: str = prefix) -> str:
            flat = graph.op("MatMul", [normed, c(prefix + name + ".weight", weight)])
            return graph.op("Transpose", [graph.op("Reshape", [flat, shape_name])],
                            perm=[0, 2, 1, 3])

        query = _rotary_nodes(graph, project("q_proj", mixer.q_proj, q_shape), cos, sin, split)
        key = _rotary_nodes(graph, project("k_proj", mixer.k_proj, kv_shape), cos, sin, split)
        value = project("v_proj", mixer.v_proj, kv_shape)
        graph.rename(key, f"present.{layer}.key")
        graph.rename(value, f"present.{layer}.value")

        def rolled(past: str, new: str) -> str:
            window_kv = graph.op("Slice", [graph.op("Concat", [past, new], axis=2), *window])
            spread = graph.op("Expand", [graph.op("Unsqueeze", [window_kv, axis_group]), expanded])
            return graph.op("Reshape", [spread, repeated])

        keys = rolled(f"past_key_values.{layer}.key", key)
        values = rolled(f"past_key_values.{layer}.value", value)
        scores = graph.op("Add", [graph.op("Mul", [
            graph.op("MatMul", [query, graph.op("Transpose", [keys], perm=[0, 1, 3, 2])]), scale]),
            "attention_mask"])
        attended = graph.op("MatMul", [graph.op("Softmax", [scores], axis=-1), values])
        attended = graph.op("Reshape", [graph.op("Transpose", [attended], perm=[0, 2, 1, 3]),
                                        merged])
        hidden = graph.op("Add", [hidden, graph.op("MatMul", [
            attended, c(prefix + "o_proj.weight", mixer.o_proj)])])
        normed = _rms_norm_nodes(graph, hidden, c(prefix + "post_norm.weight",
                                                  layer_weights.post_norm), eps, last_axis)
        gate = graph.op("MatMul", [normed, c(prefix + "gate_proj.weight", layer_weights.gate_proj)])
        up = graph.op("MatMul", [normed, c(prefix + "up_proj.weight", layer_weights.up_proj)])
        mlp = graph.op("Mul", [graph.op("Mul", [gate, graph.op("Sigmoid", [gate])]), up])
        hidden = graph.op("Add", [hidden, graph.op("MatMul", [
            mlp, c(prefix + "down_proj.weight", layer_weights.down_proj)])])
    normed = _rms_norm_nodes(graph, hidden, c("final_norm.weight", weights.final_norm), eps,
                             last_axis)
    graph.rename(graph.op("MatMul", [normed, c("lm_head.weight", weights.lm_head)]), "logits")

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    kv_in = [1, kv_heads, cap, head_size]
    kv_out = [1, kv_heads, rows, head_size]
    inputs = [helper.make_tensor_value_info("input_ids", i64, [1, rows]),
              helper.make_tensor_value_info("position_ids", i64, [1, rows]),
              helper.make_tensor_value_info("attention_mask", f32, [1, 1, rows, cap])]
    outputs = [helper.make_tensor_value_info("logits", f32, [1, rows, config.vocab_size])]
    for layer in range(config.num_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{layer}.{kind}", f32,
                                                        kv_in))
            outputs.append(helper.make_tensor_value_info(f"present.{layer}.{kind}", f32, kv_out))
    return helper.make_graph(graph.nodes, "static_decoder", inputs, outputs, graph.initializers)


def static_model_proto(
    config: DecoderConfig, weights: DecoderWeights, shape: StaticShape
) -> onnx.ModelProto:
    """The static decoder as an in-memory ModelProto (weights embedded), with its sizes in
    metadata (`onnx_chunk.static.*`: chunk_size, capacity, max_positions, pad/eos token ids)."""
    config = _static_config(config)
    model = helper.make_model(_static_graph(config, weights, shape),
                              opset_imports=[helper.make_opsetid("", STATIC_OPSET)],
                              producer_name="onnx-chunk", ir_version=STATIC_IR_VERSION)
    metadata = {"chunk_size": shape.chunk_size, "capacity": shape.capacity,
                "max_positions": config.max_positions, "pad_token_id": config.pad_token_id,
                "eos_token_id": config.eos_token_id}
    helper.set_model_props(model, {METADATA_PREFIX + key: str(value)
                                   for key, value in metadata.items()})
    return model


def build_static_decoder(
    out_dir: str | os.PathLike,
    preset: str = "tiny",
    *,
    chunk_size: int,
    capacity: int,
    seed: int = 0,
    **overrides,
) -> Path:
    """Write a static reference decoder (rows = `chunk_size`, KV capacity = `capacity`) with the
    weights `make_weights(config_for(preset, **overrides), seed)`; returns `out_dir/model.onnx`.

    The weights are stored as external data (`model.onnx.data`); both files are staged in a
    temporary folder inside `out_dir` and renamed into place (`staged_output.staged_write`).
    """
    config = _static_config(config_for(preset, **overrides))
    shape = StaticShape(chunk_size, capacity)
    model = static_model_proto(config, make_weights(config, seed), shape)
    out = Path(out_dir)
    target = out / MODEL_FILE
    data_name = MODEL_FILE + ".data"
    with _staged_write(out) as staging:
        _save_external(model, staging.path / MODEL_FILE, data_name)
        staging.publish([data_name, MODEL_FILE])
    logger.info("wrote static decoder %s (c=%d, C=%d, preset %s, seed %d)", target,
                chunk_size, capacity, preset, seed)
    return target


def build_static_pair(
    out_dir: str | os.PathLike,
    preset: str = "tiny",
    *,
    chunk_size: int,
    capacity: int,
    seed: int = 0,
    **overrides,
) -> tuple[Path, Path]:
    """Write a runnable static folder: `model.onnx` (rows = `chunk_size`) and `decode.onnx`
    (rows 1), the same weights and KV capacity; returns both paths.

    The two graphs differ only in small inline shape constants, so their external weights are
    byte for byte the same: both refer to the one file `model.onnx.data`. All three files are
    staged in a temporary folder inside `out_dir` and renamed into place at the end, so a
    failure leaves no half-written pair.
    """
    if chunk_size < 2:
        raise ConfigError(
            f"the chunk graph of a static pair needs chunk size c >= 2 (the decode graph is the "
            f"c=1 one), got c={chunk_size}"
        )
    config = _static_config(config_for(preset, **overrides))
    weights = make_weights(config, seed)
    chunk = static_model_proto(config, weights, StaticShape(chunk_size, capacity))
    decode = static_model_proto(config, weights, StaticShape(1, capacity))
    out = Path(out_dir)
    data_name = MODEL_FILE + ".data"
    with _staged_write(out) as staging:
        staged = staging.path
        _save_external(chunk, staged / MODEL_FILE, data_name)
        (staged / "decode").mkdir()
        _save_external(decode, staged / "decode" / DECODE_FILE, data_name)
        if not filecmp.cmp(staged / data_name, staged / "decode" / data_name, shallow=False):
            raise OutputError(
                "the chunk and decode graphs' external weights differ; they cannot share "
                f"{data_name} (a builder bug: report it)"
            )
        (staged / "decode" / DECODE_FILE).replace(staged / DECODE_FILE)
        staging.publish([data_name, MODEL_FILE, DECODE_FILE])
    logger.info("wrote static pair %s and %s (c=%d, C=%d, preset %s, seed %d)", out / MODEL_FILE,
                out / DECODE_FILE, chunk_size, capacity, preset, seed)
    return out / MODEL_FILE, out / DECODE_FILE


@contextmanager
def _staged_write(out: Path) -> Iterator[Staging]:
    """`staged_output.staged_write` of model.onnx into `out`; OutputError when it cannot be
    written."""
    try:
        with staged_write(out, MODEL_FILE) as staging:
            yield staging
    except OutputError:  # already says what to do; an OSError too, not to be wrapped
        raise
    except OSError as error:
        raise OutputError(f"cannot write into {out}: {error}; check the folder is writable") \
            from error


def _save_external(model: onnx.ModelProto, target: Path, data_name: str) -> None:
    onnx.save_model(model, target, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_name)
