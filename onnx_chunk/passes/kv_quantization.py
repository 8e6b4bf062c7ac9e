"""Rewrite GroupQueryAttention's KV cache to int8 or packed int4 with calibrated scales."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from onnx_chunk.errors import ConfigError, ModelStructureError
from onnx_chunk.graph import metadata
from onnx_chunk.passes import value_tracing
from onnx_chunk.passes.kv_prefill import unwrapped
from onnx_chunk.passes.preconditions import precondition

logger = logging.getLogger(__name__)

# GroupQueryAttention's inputs and outputs, as ONNX Runtime's schema numbers them
# (onnxruntime/core/graph/contrib_ops/bert_defs.cc): past_key 3, past_value 4, k_scale 12,
# v_scale 13; present_key 1, present_value 2.
_QUERY_INPUT = 0
_PAST_KEY_INPUT, _PAST_VALUE_INPUT = 3, 4
_K_SCALE_INPUT, _V_SCALE_INPUT = 12, 13
_PRESENT_KEY_OUTPUT, _PRESENT_VALUE_OUTPUT = 1, 2
_HEAD_AXIS = 3

KV_DTYPES = ("int8", "int4")
KV_SCALES = ("per-channel", "per-tensor")
# The attribute value of each --kv-scales choice (`k_quant_type` / `v_quant_type`).
_QUANT_TYPES = {"per-channel": "PER_CHANNEL", "per-tensor": "PER_TENSOR"}
# Cache element types: int8 one value a byte; int4 two values a byte in a uint8 (the CPU
# kernel in onnxruntime/contrib_ops/cpu/bert/group_query_attention.cc sizes the head axis
# (head_size + 1) / 2 and reads the cache as uint8 when kv_cache_bit_width is 4).
CACHE_TYPES = {"int8": ir.DataType.INT8, "int4": ir.DataType.UINT8}
_BITS = {"int8": 8, "int4": 4}
# The largest magnitude the symmetric code holds without clipping: int8 [-128, 127], int4
# [-8, 7] (stored as value + 8 in a nibble, the element with the even index in the low one;
# probed on the 1.32 CPU kernel), so a range of r gets the scale r / 127 or r / 7.
QMAX = {"int8": 127.0, "int4": 7.0}
# The CPU kernel quantizes with MLAS in groups of 8 channels: it refuses other head sizes
# ("head_size must be a multiple of 8", ONNX Runtime 1.32).
HEAD_SIZE_MULTIPLE = 8
# A window-sized cache (`sliding_window_cache=1`) in 4 bits needs head sizes in multiples of 32
# ("sliding_window_cache: head_size (16) must be a multiple of 32 for a 4-bit KV cache", 1.32).
WINDOW_INT4_HEAD_SIZE_MULTIPLE = 32


@dataclasses.dataclass(frozen=True)
class KVRange:
    """The largest magnitude calibration saw in one KV cache, per channel: [kv_heads, head]."""

    amax: np.ndarray


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What calibration measured (`onnx_chunk.calibration.calibrate_kv`): each KV cache
    input's range, keyed by the input's name, and what it ran on."""

    ranges: dict[str, KVRange]
    prompts: int
    tokens: int
    source: str


def scale_values(amax: np.ndarray, kv_dtype: str, kv_scales: str) -> np.ndarray:
    """The float32 scale tensor for one cache: [1] per tensor, [1, kv_heads, 1, head] per
    channel.

    A channel calibration never saw move (range 0) gets the smallest nonzero channel's scale,
    so the kernel never divides by zero; the caller has refused a cache whose whole range is 0.
    """
    amax = np.asarray(amax, dtype=np.float64)
    qmax = QMAX[kv_dtype]
    if kv_scales == "per-tensor":
        return np.array([amax.max() / qmax], dtype=np.float32)
    floor = amax[amax > 0].min()
    per_channel = np.where(amax > 0, amax, floor) / qmax
    return per_channel.reshape(1, amax.shape[0], 1, amax.shape[1]).astype(np.float32)


def cache_scales(model: ir.Model) -> dict[str, np.ndarray]:
    """The scale of every quantized cache input, keyed by the input's name: the k_scale or
    v_scale initializer of the GroupQueryAttention that reads it (none for a float cache)."""
    scales = {}
    for node in value_tracing.gqa_nodes(model.graph):
        for past_index, scale_index in ((_PAST_KEY_INPUT, _K_SCALE_INPUT),
                                        (_PAST_VALUE_INPUT, _V_SCALE_INPUT)):
            past = value_tracing.input_at(node, past_index)
            scale = value_tracing.input_at(node, scale_index)
            if past is not None and past.name and scale is not None and (
                    scale.const_value is not None):
                scales[past.name] = np.asarray(scale.const_value.numpy(), dtype=np.float32)
    return scales


def dequantize(stored: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 values GroupQueryAttention reads from a quantized cache [..., width]: int8
    codes, or uint8 bytes of two 4-bit codes each (value + 8, the even channel in the low
    nibble), times `scale` ([1], or [1, kv_heads, 1, head_size] per channel)."""
    if stored.dtype == np.uint8:
        nibbles = np.stack([stored & 0x0F, stored >> 4], axis=-1)
        codes = nibbles.reshape(*stored.shape[:-1], -1).astype(np.int16) - 8
        head_size = scale.shape[-1] if scale.ndim == 4 else codes.shape[-1]
        codes = codes[..., :head_size]
    elif stored.dtype == np.int8:
        codes = stored.astype(np.int16)
    else:
        raise ValueError(f"a quantized cache is int8 or uint8 (packed int4), got {stored.dtype}")
    return codes.astype(np.float32) * scale


@dataclasses.dataclass(frozen=True)
class _Cache:
    """One node's past input (a graph input) and present output (a graph output)."""

    past: ir.Value
    present: ir.Value


@dataclasses.dataclass(frozen=True)
class _Target:
    node: ir.Node
    caches: tuple[_Cache, _Cache]  # key, value
    kv_heads: int
    head_size: int


def find_quantizable_caches(model: ir.Model, kv_dtype: str = "int8") -> list[_Target]:
    """Every GroupQueryAttention node with its caches; ModelStructureError naming the first
    node the rewrite to a `kv_dtype` cache cannot apply to, and why (rule 1)."""
    graph = model.graph
    nodes = value_tracing.gqa_nodes(graph)
    if not nodes:
        raise ModelStructureError(
            "the model's attention is not com.microsoft::GroupQueryAttention, and only that "
            "operator reads a quantized KV cache; --kv-dtype applies to GroupQueryAttention "
            "exports (a concat-KV decoder converts with --kv-cache gqa)")
    graph_inputs = {id(value) for value in graph.inputs}
    graph_outputs = {id(value) for value in graph.outputs}
    targets = []
    for node in nodes:
        label = f"GroupQueryAttention {node.name!r}"
        query = value_tracing.input_at(node, _QUERY_INPUT)
        # A type the graph leaves undeclared (the concat-KV rewrite's) is taken as float32.
        if query is not None and query.dtype not in (None, ir.DataType.FLOAT):
            raise ModelStructureError(
                f"{label} computes in {query.dtype}; "
                "ONNX Runtime's CPU kernel reads a quantized KV cache in float32 attention "
                "only: convert a float32 (or INT4-weight) export")
        caches = []
        for past_index, present_index in ((_PAST_KEY_INPUT, _PRESENT_KEY_OUTPUT),
                                          (_PAST_VALUE_INPUT, _PRESENT_VALUE_OUTPUT)):
            past = value_tracing.input_at(node, past_index)
            present = node.outputs[present_index] if present_index < len(node.outputs) else None
            if past is None or id(past) not in graph_inputs:
                raise ModelStructureError(
                    f"{label}: its input {past_index} is not a graph input, so the cache it "
                    "reads cannot be retyped")
            if present is None or id(present) not in graph_outputs:
                raise ModelStructureError(
                    f"{label}: its output {present_index} is not a graph output, so the cache "
                    "it writes cannot be retyped")
            if len(past.uses()) != 1:
                raise ModelStructureError(
                    f"{label}: the cache input {past.name!r} is read by other nodes too, which "
                    "would read quantized bytes as floats")
            caches.append(_Cache(past, present))
        kv_heads = node.attributes.get("kv_num_heads")
        head_size = value_tracing.gqa_head_size(node, caches[0].past,
                                 int(kv_heads.as_int()) if kv_heads else 0)
        if kv_heads is None or head_size is None:
            raise ModelStructureError(f"{label}: its KV head count or head size is unknown, so "
                                      "its scales cannot be shaped")
        if head_size % HEAD_SIZE_MULTIPLE:
            raise ModelStructureError(
                f"{label} has head size {head_size}; ONNX Runtime's CPU kernel quantizes the "
                f"KV cache in groups of {HEAD_SIZE_MULTIPLE} channels and refuses other head "
                "sizes")
        window = node.attributes.get("sliding_window_cache")
        if (kv_dtype == "int4" and window is not None and window.as_int() == 1
                and head_size % WINDOW_INT4_HEAD_SIZE_MULTIPLE):
            raise ModelStructureError(
                f"{label} keeps a window-sized cache with head size {head_size}; ONNX "
                "Runtime's CPU kernel quantizes such a cache to int4 only for head sizes that "
                f"are a multiple of {WINDOW_INT4_HEAD_SIZE_MULTIPLE}: use --kv-dtype int8")
        targets.append(_Target(node, (caches[0], caches[1]), int(kv_heads.as_int()), head_size))
    return targets


class KVCacheQuantizationPass(ir.passes.InPlacePass):
    """Give every GroupQueryAttention an int8 or packed-int4 KV cache with calibrated scales.

    ONNX Runtime's GroupQueryAttention (onnxruntime/core/graph/contrib_ops/bert_defs.cc, CPU
    kernel onnxruntime/contrib_ops/cpu/bert/group_query_attention.cc and gqa_attention_base.h)
    quantizes each new K/V row into the cache with a fixed scale (symmetric, round to nearest)
    and dequantizes the cache as it attends; the query and the attention stay float32.

    Rules:
    1. Every `com.microsoft::GroupQueryAttention` is rewritten; a model with none, or whose
       attention computes in another type than float32, is refused (the CPU kernel quantizes
       for float32 only), as is a head size that is not a multiple of 8 (the kernel's own
       limit), a window-sized cache (`sliding_window_cache=1`) in int4 whose head size is not a
       multiple of 32 (the kernel's limit there), and a cache input that is no graph input
       read by that node alone, or a present that is no graph output.
    2. The node's past_key/past_value inputs and present_key/present_value outputs are
       retyped: int8 (`kv_dtype="int8"`) or uint8 holding two 4-bit values a byte along the
       head axis (`"int4"`); the head axis (3) gets the fixed size head_size or
       ceil(head_size / 2).
    3. Inputs 12 and 13 (k_scale, v_scale) become float32 initializers named
       `<cache input>.scale`: one value (`"per-tensor"`, shape [1]) or one per KV head and
       channel (`"per-channel"`, shape [1, kv_heads, 1, head_size]), the calibrated range
       over the code's largest magnitude (127 for int8, 7 for int4); the CPU kernel needs K
       and V of one node quantized alike.
    4. Attributes `k_quant_type` and `v_quant_type` (PER_TENSOR or PER_CHANNEL) and
       `kv_cache_bit_width` (8 or 4) are set.
    5. A cache with no range (the calibration lacks it) is refused, and so is one whose range
       is zero everywhere (calibration never wrote a nonzero value: the scale would be 0),
       naming it.
    6. The cache type, the scale granularity and the calibration's size and source go to the
       inference metadata (`onnx_chunk.kv_cache`).
    7. Running it again with the same calibration reports `modified=False`; a model whose
       cache is already quantized otherwise is refused: quantize the float export.
    """

    def __init__(self, calibration: Calibration, kv_dtype: str = "int8",
                 kv_scales: str = "per-channel") -> None:
        super().__init__()
        if kv_dtype not in KV_DTYPES:
            raise ConfigError(f"unknown KV cache dtype {kv_dtype!r}; expected one of "
                              f"{', '.join(KV_DTYPES)}")
        if kv_scales not in KV_SCALES:
            raise ConfigError(f"unknown KV scale granularity {kv_scales!r}; expected one of "
                              f"{', '.join(KV_SCALES)}")
        self.calibration = calibration
        self.ranges: Mapping[str, KVRange] = calibration.ranges
        self.kv_dtype = kv_dtype
        self.kv_scales = kv_scales

    def requires(self, model: ir.Model) -> None:
        """Rules 1, 5 and 7 for every node, before any node is rewritten."""
        with precondition(), unwrapped(model):
            self._planned(model)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        with unwrapped(model):  # a prefill routed to float attention (passes.kv_prefill)
            for target, scales in self._planned(model):
                modified = self._rewrite(model, target, scales) or modified
        declaration = metadata.KVCacheDeclaration(
            dtype=self.kv_dtype, scales=self.kv_scales,
            calibration_prompts=self.calibration.prompts,
            calibration_tokens=self.calibration.tokens,
            calibration_source=self.calibration.source)
        modified = metadata.write_kv_cache(model, declaration) or modified
        if modified:
            logger.info("KV cache quantized to %s (%s scales)", self.kv_dtype, self.kv_scales)
        return ir.passes.PassResult(model, modified=modified)

    def _planned(self, model: ir.Model) -> list[tuple[_Target, list[np.ndarray]]]:
        """Every node to quantize with the scales of its two caches; the refusals of rules 1, 5
        and 7 (a node whose cache is quantized otherwise)."""
        planned = []
        for target in find_quantizable_caches(model, self.kv_dtype):
            scales = [self._scale(cache, target) for cache in target.caches]
            if not self._already(target, scales) and any(
                    cache.past.dtype != ir.DataType.FLOAT for cache in target.caches):
                raise ModelStructureError(
                    f"GroupQueryAttention {target.node.name!r} already has a "
                    f"{target.caches[0].past.dtype} KV cache; quantize the float export instead")
            planned.append((target, scales))
        return planned

    def _rewrite(self, model: ir.Model, target: _Target, scales: list[np.ndarray]) -> bool:
        node = target.node
        cache_type = CACHE_TYPES[self.kv_dtype]
        head = (target.head_size if self.kv_dtype == "int8" else (target.head_size + 1) // 2)
        if self._already(target, scales):
            return False
        for cache in target.caches:
            for value in (cache.past, cache.present):
                value.dtype = cache_type
                if value.shape is not None:
                    dims = list(value.shape)
                    dims[_HEAD_AXIS] = head
                    value.shape = ir.Shape(dims)
        inputs = list(node.inputs)
        inputs.extend([None] * (_V_SCALE_INPUT + 1 - len(inputs)))
        for index, cache, scale in zip((_K_SCALE_INPUT, _V_SCALE_INPUT), target.caches, scales):
            name = f"{cache.past.name}.scale"
            value = ir.Value(name=name, shape=ir.Shape(scale.shape), type=ir.TensorType(
                ir.DataType.FLOAT), const_value=ir.tensor(scale, name=name))
            model.graph.register_initializer(value)
            inputs[index] = value
        _replace_inputs(node, inputs)
        quant_type = _QUANT_TYPES[self.kv_scales]
        node.attributes["k_quant_type"] = ir.AttrString("k_quant_type", quant_type)
        node.attributes["v_quant_type"] = ir.AttrString("v_quant_type", quant_type)
        node.attributes["kv_cache_bit_width"] = ir.AttrInt64("kv_cache_bit_width",
                                                             _BITS[self.kv_dtype])
        return True

    def _scale(self, cache: _Cache, target: _Target) -> np.ndarray:
        name = cache.past.name or ""
        if name not in self.ranges:
            raise ModelStructureError(f"no calibrated range for the KV cache {name!r}; "
                                      "calibrate on the same model")
        amax = np.asarray(self.ranges[name].amax)
        if amax.shape != (target.kv_heads, target.head_size):
            raise ModelStructureError(
                f"the calibrated range of {name!r} has shape {list(amax.shape)}, the cache "
                f"[{target.kv_heads}, {target.head_size}] (kv heads, head size)")
        if not np.all(np.isfinite(amax)) or not (amax > 0).any():
            raise ConfigError(
                f"calibration left the KV cache {name!r} (GroupQueryAttention "
                f"{target.node.name!r}) with a range of zero, so it has no scale: calibrate "
                "on text that reaches that layer with nonzero keys and values")
        return scale_values(amax, self.kv_dtype, self.kv_scales)

    def _already(self, target: _Target, scales: list[np.ndarray]) -> bool:
        """Whether the node already reads this cache type with exactly these scales."""
        node = target.node
        if any(cache.past.dtype != CACHE_TYPES[self.kv_dtype] for cache in target.caches):
            return False
        bits = node.attributes.get("kv_cache_bit_width")
        quant = node.attributes.get("k_quant_type")
        if bits is None or bits.as_int() != _BITS[self.kv_dtype] or quant is None or (
                quant.as_string() != _QUANT_TYPES[self.kv_scales]):
            return False
        for index, scale in zip((_K_SCALE_INPUT, _V_SCALE_INPUT), scales):
            value = value_tracing.input_at(node, index)
            if value is None or value.const_value is None:
                return False
            if not np.array_equal(value.const_value.numpy(), scale):
                return False
        return True


def _replace_inputs(node: ir.Node, inputs: list[ir.Value | None]) -> None:
    for index, value in enumerate(inputs):
        if index < len(node.inputs):
            node.replace_input_with(index, value)
        else:
            node.resize_inputs(index + 1)
            node.replace_input_with(index, value)
