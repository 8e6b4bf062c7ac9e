"""The ONNX graph of a reference decoder, laid out like onnxruntime-genai's model builder.

Inputs `input_ids` (or `inputs_embeds`), `attention_mask`, `past_key_values.%d.key/value`
(and `past.%d.conv` for conv layers, `position_ids` or `row_scale` for those variants);
outputs `logits`, `present.%d.key/value` (and `present.%d.conv`). Attention is
`com.microsoft::GroupQueryAttention` with rotary inside; `seqlens_k` and
`total_sequence_length` are derived from `attention_mask` the way the builder does it.

A float16 graph (for CUDA, whose GroupQueryAttention kernel has no float32 version) holds its
weights, cos/sin caches, activations, KV and logits in float16; RMSNorm casts to float32 for
the mean of squares and back, like the float32 accumulation inside the builder's fused
SimplifiedLayerNormalization.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np
import onnx_ir as ir

from onnx_chunk.models.config import DecoderConfig
from onnx_chunk.models.precision import float_dtype
from onnx_chunk.models.variants import ROW_SCALE_INPUT, VariantSpec
from onnx_chunk.models.weights import AttentionWeights, ConvWeights, DecoderWeights, LayerWeights

OPSET = 21
MS_DOMAIN = "com.microsoft"
METADATA_KEY = "onnx_chunk.reference_decoder"
_INT64_MAX = np.iinfo(np.int64).max


def linear_output_name(layer: int | None, module: str) -> str:
    """Name of the value a linear projection writes; stable across INT4 quantization.

    The quantizer swaps MatMul for MatMulNBits but keeps the output value, so the NumPy
    reference finds each projection's weight through this name. lm_head writes `logits`.
    """
    if layer is None and module == "lm_head":
        return "logits"
    prefix = "/model" if layer is None else f"/model/layers.{layer}"
    return f"{prefix}/{module}/MatMul/output_0"


def rotary_caches(config: DecoderConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches [max_positions, head_size/2] for non-interleaved (half-split) rotary."""
    half = config.head_size // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(half, dtype=np.float64) * 2.0
                                            / config.head_size))
    angles = np.outer(np.arange(config.max_positions, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class _Graph:
    """Collects nodes and initializers; every node output gets the builder's naming scheme.

    `float_type` is the decoder's precision: `param` stores a weight in it, `weight` as given.
    """

    def __init__(self, float_dtype: np.dtype) -> None:
        self.float_dtype = np.dtype(float_dtype)
        self.float_type = ir.DataType.from_numpy(self.float_dtype)
        self.nodes: list[ir.Node] = []
        self.initializers: list[ir.Value] = []
        self._constants: dict[tuple, ir.Value] = {}

    def weight(self, name: str, array: np.ndarray) -> ir.Value:
        value = ir.Value(name=name, shape=ir.Shape(array.shape),
                         type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                         const_value=ir.Tensor(array, name=name))
        self.initializers.append(value)
        return value

    def param(self, name: str, array: np.ndarray) -> ir.Value:
        return self.weight(name, array.astype(self.float_dtype))

    def constant(self, values: list[int] | list[float] | int | float, dtype=np.int64) -> ir.Value:
        array = np.array(values, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            kind = ir.DataType.from_numpy(array.dtype).name
            name = f"/model/constants/{kind}/{list(array.shape)}/{array.tolist()}"
            self._constants[key] = self.weight(name, array)
        return self._constants[key]

    def op(self, name: str, op_type: str, inputs: Sequence[ir.Value | None],
           attributes: dict | None = None, *, domain: str = "", num_outputs: int = 1,
           output_names: list[str] | None = None) -> list[ir.Value]:
        names = output_names or [f"{name}/output_{i}" for i in range(num_outputs)]
        outputs = [ir.Value(name=out) for out in names]
        attrs = [ir.convenience.convert_attribute(key, value)
                 for key, value in (attributes or {}).items()]
        node = ir.Node(domain, op_type, inputs, attrs, outputs=outputs, name=name)
        self.nodes.append(node)
        return outputs

    def op1(self, name: str, op_type: str, inputs: Sequence[ir.Value | None],
            attributes: dict | None = None, **kwargs) -> ir.Value:
        return self.op(name, op_type, inputs, attributes, **kwargs)[0]


def _tensor_value(name: str, dtype: ir.DataType, shape: Sequence[int | str]) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype))


def _rms_norm(g: _Graph, base: str, x: ir.Value, gamma: ir.Value, eps: float) -> ir.Value:
    narrow = g.float_type != ir.DataType.FLOAT
    if narrow:
        x = g.op1(f"{base}/Cast", "Cast", [x], {"to": ir.DataType.FLOAT})
    square = g.op1(f"{base}/Mul", "Mul", [x, x])
    mean = g.op1(f"{base}/ReduceMean", "ReduceMean", [square, g.constant([-1])],
                 {"keepdims": 1})
    shifted = g.op1(f"{base}/Add", "Add", [mean, g.constant(eps, np.float32)])
    root = g.op1(f"{base}/Sqrt", "Sqrt", [shifted])
    inverse = g.op1(f"{base}/Reciprocal", "Reciprocal", [root])
    normed = g.op1(f"{base}/Mul_1", "Mul", [x, inverse])
    if narrow:
        normed = g.op1(f"{base}/Cast_1", "Cast", [normed], {"to": g.float_type})
    return g.op1(f"{base}/Mul_2", "Mul", [normed, gamma])


def _linear(g: _Graph, layer: int | None, module: str, x: ir.Value, weight: np.ndarray,
            weight_name: str) -> ir.Value:
    prefix = "/model" if layer is None else f"/model/layers.{layer}"
    return g.op1(f"{prefix}/{module}/MatMul", "MatMul", [x, g.param(weight_name, weight)],
                 output_names=[linear_output_name(layer, module)])


def _attention(g: _Graph, config: DecoderConfig, layer: int, weights: AttentionWeights,
               x: ir.Value, mask_info: tuple[ir.Value, ir.Value],
               caches: tuple[ir.Value, ir.Value], position_ids: ir.Value | None,
               io: dict[str, list[ir.Value]]) -> ir.Value:
    kv_shape: list[int | str] = ["batch_size", config.num_kv_heads, "past_sequence_length",
                                 config.head_size]
    present_shape: list[int | str] = ["batch_size", config.num_kv_heads,
                                      "total_sequence_length", config.head_size]
    past_key = _tensor_value(f"past_key_values.{layer}.key", g.float_type, kv_shape)
    past_value = _tensor_value(f"past_key_values.{layer}.value", g.float_type, kv_shape)
    io["inputs"] += [past_key, past_value]
    stem = f"model.layers.{layer}.attn"
    q = _linear(g, layer, "attn/q_proj", x, weights.q_proj, f"{stem}.q_proj.MatMul.weight")
    k = _linear(g, layer, "attn/k_proj", x, weights.k_proj, f"{stem}.k_proj.MatMul.weight")
    v = _linear(g, layer, "attn/v_proj", x, weights.v_proj, f"{stem}.v_proj.MatMul.weight")
    seqlens_k, total_len = mask_info
    cos_cache, sin_cache = caches
    inputs = [q, k, v, past_key, past_value, seqlens_k, total_len]
    if position_ids is None:
        inputs += [cos_cache, sin_cache]
    else:
        # GQA's CPU kernel derives rotary positions from seqlens_k and ignores its position_ids
        # input, so explicit positions go through RotaryEmbedding before attention.
        base = f"/model/layers.{layer}/attn"
        q = g.op1(f"{base}/q_rotary/RotaryEmbedding", "RotaryEmbedding",
                  [q, position_ids, cos_cache, sin_cache],
                  {"interleaved": 0, "num_heads": config.num_heads}, domain=MS_DOMAIN)
        k = g.op1(f"{base}/k_rotary/RotaryEmbedding", "RotaryEmbedding",
                  [k, position_ids, cos_cache, sin_cache],
                  {"interleaved": 0, "num_heads": config.num_kv_heads}, domain=MS_DOMAIN)
        inputs[0], inputs[1] = q, k
    name = f"/model/layers.{layer}/attn/GroupQueryAttention"
    attn, present_key, present_value = g.op(
        name, "GroupQueryAttention", inputs,
        {"num_heads": config.num_heads, "kv_num_heads": config.num_kv_heads,
         "scale": float(1.0 / np.sqrt(config.head_size)),
         "do_rotary": int(position_ids is None), "rotary_interleaved": 0,
         "local_window_size": -1},
        domain=MS_DOMAIN,
        output_names=[f"{name}/output_0", f"present.{layer}.key", f"present.{layer}.value"])
    for value in (present_key, present_value):
        value.shape = ir.Shape(present_shape)
        value.type = ir.TensorType(g.float_type)
    io["outputs"] += [present_key, present_value]
    return _linear(g, layer, "attn/o_proj", attn, weights.o_proj, f"{stem}.o_proj.MatMul.weight")


def _short_conv(g: _Graph, config: DecoderConfig, layer: int, weights: ConvWeights,
                x: ir.Value, io: dict[str, list[ir.Value]]) -> ir.Value:
    h, width = config.hidden_size, config.conv_kernel - 1
    base = f"/model/layers.{layer}/conv"
    past = _tensor_value(f"past.{layer}.conv", g.float_type, ["batch_size", h, width])
    io["inputs"].append(past)
    stem = f"model.layers.{layer}.conv"
    projected = _linear(g, layer, "conv/in_proj", x, weights.in_proj,
                        f"{stem}.in_proj.MatMul.weight")
    b_gate, c_gate, signal = g.op(f"{base}/Split", "Split", [projected, g.constant([h, h, h])],
                                  {"axis": -1}, num_outputs=3)
    gated = g.op1(f"{base}/Mul", "Mul", [b_gate, signal])
    channels_first = g.op1(f"{base}/Transpose", "Transpose", [gated], {"perm": [0, 2, 1]})
    window = g.op1(f"{base}/Concat", "Concat", [past, channels_first], {"axis": 2})
    kernel = g.param(f"{stem}.conv.weight", weights.kernel.reshape(h, 1, config.conv_kernel))
    convolved = g.op1(f"{base}/Conv", "Conv", [window, kernel],
                      {"group": h, "kernel_shape": [config.conv_kernel]})
    present = g.op1(f"{base}/Slice", "Slice",
                    [window, g.constant([-width]), g.constant([_INT64_MAX]), g.constant([2])],
                    output_names=[f"present.{layer}.conv"])
    present.shape = ir.Shape(["batch_size", h, width])
    present.type = ir.TensorType(g.float_type)
    io["outputs"].append(present)
    rows_first = g.op1(f"{base}/Transpose_1", "Transpose", [convolved], {"perm": [0, 2, 1]})
    mixed = g.op1(f"{base}/Mul_1", "Mul", [c_gate, rows_first])
    return _linear(g, layer, "conv/out_proj", mixed, weights.out_proj,
                   f"{stem}.out_proj.MatMul.weight")


def _swiglu(g: _Graph, layer: int, x: ir.Value, layer_weights: LayerWeights) -> ir.Value:
    stem = f"model.layers.{layer}.mlp"
    base = f"/model/layers.{layer}/mlp"
    gate = _linear(g, layer, "mlp/gate_proj", x, layer_weights.gate_proj,
                   f"{stem}.gate_proj.MatMul.weight")
    up = _linear(g, layer, "mlp/up_proj", x, layer_weights.up_proj,
                 f"{stem}.up_proj.MatMul.weight")
    sigmoid = g.op1(f"{base}/act_fn/Sigmoid", "Sigmoid", [gate])
    silu = g.op1(f"{base}/act_fn/Mul", "Mul", [gate, sigmoid])
    product = g.op1(f"{base}/Mul", "Mul", [silu, up])
    return _linear(g, layer, "mlp/down_proj", product, layer_weights.down_proj,
                   f"{stem}.down_proj.MatMul.weight")


def _mask_reformatting(g: _Graph, attention_mask: ir.Value) -> tuple[ir.Value, ir.Value]:
    base = "/model/attn_mask_reformat/attn_mask_subgraph"
    total = g.op1(f"{base}/ReduceSum", "ReduceSum", [attention_mask, g.constant([1])],
                  {"keepdims": 0})
    last = g.op1(f"{base}/Sub", "Sub", [total, g.constant([1])])
    seqlens_k = g.op1(f"{base}/Sub/Cast", "Cast", [last], {"to": ir.DataType.INT32})
    shape = g.op1(f"{base}/Shape", "Shape", [attention_mask])
    width = g.op1(f"{base}/Gather", "Gather", [shape, g.constant(1)], {"axis": 0})
    total_len = g.op1(f"{base}/Gather/Cast", "Cast", [width], {"to": ir.DataType.INT32})
    return seqlens_k, total_len


def build_graph(config: DecoderConfig, weights: DecoderWeights, spec: VariantSpec,
                seed: int, dtype: str = "float32") -> ir.Model:
    """The decoder of `config` and `weights` in precision `dtype` with the features of `spec`.

    INT4 is applied afterwards by the quantizer; this graph has plain MatMul weights.
    """
    g = _Graph(float_dtype(dtype))
    io: dict[str, list[ir.Value]] = {"inputs": [], "outputs": []}
    h = config.hidden_size
    if spec.inputs_embeds:
        embeds = _tensor_value("inputs_embeds", g.float_type,
                               ["batch_size", "sequence_length", h])
        io["inputs"].append(embeds)
        hidden = embeds
    else:
        input_ids = _tensor_value("input_ids", ir.DataType.INT64,
                                  ["batch_size", "sequence_length"])
        io["inputs"].append(input_ids)
        table = g.param("model.embed_tokens.weight", weights.embedding)
        hidden = g.op1("/model/embed_tokens/Gather", "Gather", [table, input_ids])
    attention_mask = _tensor_value("attention_mask", ir.DataType.INT64,
                                   ["batch_size", "total_sequence_length"])
    io["inputs"].append(attention_mask)
    position_ids = None
    if spec.position_ids:
        position_ids = _tensor_value("position_ids", ir.DataType.INT64,
                                     ["batch_size", "sequence_length"])
        io["inputs"].append(position_ids)
    if spec.odd_port:
        row_scale = _tensor_value(ROW_SCALE_INPUT, g.float_type, ["sequence_length"])
        io["inputs"].append(row_scale)
        column = g.op1("/model/row_scale/Unsqueeze", "Unsqueeze", [row_scale, g.constant([1])])
        hidden = g.op1("/model/row_scale/Mul", "Mul", [hidden, column])
    mask_info = _mask_reformatting(g, attention_mask)
    cos, sin = rotary_caches(config)
    caches = (g.param("cos_cache", cos), g.param("sin_cache", sin))
    for layer, layer_weights in enumerate(weights.layers):
        base = f"/model/layers.{layer}"
        stem = f"model.layers.{layer}"
        normed = _rms_norm(g, f"{base}/input_layernorm", hidden,
                           g.param(f"{stem}.input_layernorm.weight", layer_weights.input_norm),
                           config.rms_norm_eps)
        if isinstance(layer_weights.mixer, ConvWeights):
            mixed = _short_conv(g, config, layer, layer_weights.mixer, normed, io)
        else:
            mixed = _attention(g, config, layer, layer_weights.mixer, normed, mask_info,
                               caches, position_ids, io)
        hidden = g.op1(f"{base}/residual_add/Add", "Add", [hidden, mixed])
        normed = _rms_norm(g, f"{base}/post_attention_layernorm", hidden,
                           g.param(f"{stem}.post_attention_layernorm.weight",
                                    layer_weights.post_norm),
                           config.rms_norm_eps)
        hidden = g.op1(f"{base}/residual_add_1/Add", "Add",
                       [hidden, _swiglu(g, layer, normed, layer_weights)])
    hidden = _rms_norm(g, "/model/norm", hidden, g.param("model.norm.weight", weights.final_norm),
                       config.rms_norm_eps)
    rows: int | str = "sequence_length"
    if spec.last_token_logits:
        hidden = g.op1("/model/last_token/Slice", "Slice",
                       [hidden, g.constant([-1]), g.constant([_INT64_MAX]), g.constant([1])])
        rows = 1
    logits = _linear(g, None, "lm_head", hidden, weights.lm_head, "lm_head.MatMul.weight")
    logits.shape = ir.Shape(["batch_size", rows, config.vocab_size])
    logits.type = ir.TensorType(g.float_type)
    outputs = [logits] + io["outputs"]
    graph = ir.Graph(io["inputs"], outputs, nodes=g.nodes, initializers=g.initializers,
                     opset_imports={"": OPSET, MS_DOMAIN: 1}, name="main_graph")
    metadata = {METADATA_KEY: json.dumps(_metadata(config, spec, seed, dtype), sort_keys=True)}
    return ir.Model(graph, ir_version=10, producer_name="onnx-chunk",
                    metadata_props=metadata)


def _metadata(config: DecoderConfig, spec: VariantSpec, seed: int, dtype: str) -> dict:
    fields = asdict(config)
    fields["conv_layers"] = list(config.conv_layers)
    return {"config": fields, "variant": spec.name, "seed": seed, "dtype": dtype}
