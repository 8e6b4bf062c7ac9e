"""Prefill chunks of a quantized KV cache attend in float32 over the dequantized cache.

ONNX Runtime's quantized GroupQueryAttention kernel (1.32, CPU) computes a prefill chunk's
Q x K^T and softmax x V one dot product at a time, dequantizing a cache row again for every query
row (MLAS's quantized-KV GEMMs inside `core/mlas/lib/flashattn_qkv.cpp`), while its float kernel
runs blocked GEMMs: a 512-row chunk over a long past costs several times the float cache's
(docs/kv_cache.md, "Prefill"). This pass keeps the quantized kernel
for forwards of one row (a decode step: there it is the faster one) and gives every forward of
several rows float attention over the cache's dequantized values, writing the codes the kernel
writes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_chunk.errors import ConfigError
from onnx_chunk.graph.query_seqlens import query_seqlens_index
from onnx_chunk.passes import value_tracing

logger = logging.getLogger(__name__)

KV_PREFILL_CHOICES = ("dequantized", "kernel")
# Forwards of at least this many query rows take the float branch; a decode step (one row)
# stays in the quantized kernel. Every prompt forward takes the same branch, so a row's numbers
# do not depend on how its prompt was cut into chunks (docs/row_grouping.md): a threshold
# above 2 would send a short remainder chunk through the kernel, which sums in another order
# than the float branch. At 8 rows or fewer the float branch costs more than the kernel at long
# context (one qwen05 layer at 8192 positions: 2.7x at 2 rows, 1.13x at 8; docs/benchmarks.md).
MIN_ROWS = 2
# Every node this pass adds is named under this prefix; its float attention is no cache's
# GroupQueryAttention (value_tracing.gqa_nodes leaves it out).
PREFIX = value_tracing.KV_PREFILL_PREFIX
# Opset 18: Split's sizes, ReduceMax's axes and BitwiseAnd as inputs or operators.
_MIN_OPSET = 18
_QUERY, _KEY, _VALUE, _PAST_KEY, _PAST_VALUE = 0, 1, 2, 3, 4
_SEQLENS_K, _COS, _SIN = 5, 7, 8
_K_SCALE, _V_SCALE = 12, 13
# Inputs the float branch does not carry over (position_ids, attention_bias, head_sink, the
# per-head norms): a node fed any of them stays in the kernel.
_UNSUPPORTED_INPUTS = (9, 10, 11, 14, 15)
_QUANT_ATTRIBUTES = ("k_quant_type", "v_quant_type", "kv_cache_bit_width")


class KVPrefillPass(ir.passes.InPlacePass):
    """Route forwards of several query rows of a quantized KV cache to float attention.

    Rules:
    1. `mode` "kernel" undoes this pass (`unwrap`): every If it made is replaced by the
       GroupQueryAttention it holds, so every forward runs ONNX Runtime's quantized kernel.
    2. `mode` "dequantized": every GroupQueryAttention of the main graph that reads a quantized
       cache (`kv_cache_bit_width` 8 or 4, constant `k_scale`/`v_scale`) becomes
       `If(query rows >= MIN_ROWS)` whose else branch is the node itself, unchanged, and whose
       outputs keep the node's names, types and shapes.
    3. The then branch, for P_b = seqlens_k + 1 - Q_b past rows of batch entry b (Q_b its
       `query_seqlens`, or every query row when the node takes none): rotary embedding at
       positions P_b + i (`RotaryEmbedding`, as the node's own); every new key and value row
       quantized as the kernel quantizes it (x times 1/scale in float32, rounded half to even,
       clipped to [-128, 127], or to [-8, 7] and packed value + 8, the even channel in the low
       nibble) and written at P_b with `ScatterND` (in place when the runtime binds the past
       and the present to one buffer, as it does); then float32 GroupQueryAttention (do_rotary
       0, the node's other attributes, total length max(P_b) + S) over the first max(P_b) + S
       rows of the cache times their scales and the new rows' codes times theirs: the values
       the kernel attends to.
       Only the order of the float sums differs (outputs within 1e-5 on float weights; a later
       layer's row at a rounding boundary may then land one code away).
    4. A node stays in the kernel (logged, not refused): a window-sized cache
       (`sliding_window_cache=1`), an input among position_ids, attention_bias, head_sink and
       the per-head norms, the `output_qk` output, a head size or head count the graph does
       not give, a model whose default opset is below 18.
    5. Running the pass again changes nothing (`modified=False`); `unwrap` then the pass
       gives the same graph back.
    """

    def __init__(self, mode: str = "dequantized") -> None:
        super().__init__()
        if mode not in KV_PREFILL_CHOICES:
            raise ConfigError(f"unknown KV prefill {mode!r}; expected one of "
                              f"{', '.join(KV_PREFILL_CHOICES)}")
        self.mode = mode

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.mode == "kernel":
            return ir.passes.PassResult(model, modified=unwrap(model))
        graph = model.graph
        if model.opset_imports.get("", 0) < _MIN_OPSET:
            logger.info("prefill stays in the quantized kernel: default opset below %d",
                        _MIN_OPSET)
            return ir.passes.PassResult(model, modified=False)
        modified = False
        for node in [node for node in graph if value_tracing.is_gqa(node)]:
            reason = _kernel_only(node)
            if reason is not None:
                logger.info("GroupQueryAttention %r stays in the quantized kernel: %s",
                            node.name, reason)
                continue
            _wrap(graph, node)
            modified = True
        return ir.passes.PassResult(model, modified=modified)


def wrappers(graph: ir.Graph) -> list[ir.Node]:
    """The If nodes this pass made in `graph`."""
    return [node for node in graph
            if node.op_type == "If" and node.domain == "" and (node.name or "").startswith(PREFIX)]


def prefill_mode(model: ir.Model) -> str | None:
    """"dequantized" when this pass wrapped the model, "kernel" for a quantized cache it did not
    wrap, None for a float cache."""
    if wrappers(model.graph):
        return "dequantized"
    quantized = any(value_tracing.is_gqa(node) and node.attributes.get("kv_cache_bit_width")
                    is not None for node in model.graph)
    return "kernel" if quantized else None


def unwrap(model: ir.Model) -> bool:
    """Put back every GroupQueryAttention this pass wrapped (rule 1); whether any was."""
    graph = model.graph
    found = wrappers(graph)
    for wrapper in found:
        branches = {name: attr.as_graph() for name, attr in wrapper.attributes.items()}
        kernel_graph, float_graph = branches["else_branch"], branches["then_branch"]
        (node,) = list(kernel_graph)
        _detach(float_graph)
        kernel_graph.outputs.clear()
        kernel_graph.remove(node)
        graph.insert_before(wrapper, node)
        for new, old in zip(node.outputs, wrapper.outputs):
            name = old.name
            old.name = f"{name}{_WRAPPED}"
            new.name = name
        ir.convenience.replace_all_uses_with(list(wrapper.outputs), list(node.outputs),
                                             replace_graph_outputs=True)
        graph.remove(wrapper, safe=True)
    ours = [node for node in graph if (node.name or "").startswith(PREFIX)]
    for node in ours:
        _clear_inputs(node)
    graph.remove(ours, safe=True)
    for name in [name for name, value in graph.initializers.items()
                 if name.endswith(_INVERSE) and not value.uses()]:
        graph.initializers.pop(name)
    return bool(found)


@contextlib.contextmanager
def unwrapped(model: ir.Model) -> Iterator[ir.Model]:
    """`model` as the kernel-only graph the other passes read, wrapped again on the way out."""
    wrapped = unwrap(model)
    try:
        yield model
    finally:
        if wrapped:
            KVPrefillPass("dequantized")(model)


_WRAPPED = "/wrapped"
_INVERSE = ".inverse"


def _kernel_only(node: ir.Node) -> str | None:
    """Why `node` stays in the quantized kernel (rule 4), or None."""
    bits = node.attributes.get("kv_cache_bit_width")
    if bits is None or bits.as_int() not in (4, 8):
        return "its cache is not quantized"
    window = node.attributes.get("sliding_window_cache")
    if window is not None and window.as_int() == 1:
        return "its cache is window-sized (sliding_window_cache=1)"
    qs_index = query_seqlens_index()
    for index, value in enumerate(node.inputs):
        if value is not None and (index in _UNSUPPORTED_INPUTS or (
                index > _V_SCALE and index != qs_index)):
            return f"its input {index} ({value.name!r}) has no counterpart in the float branch"
    if len(node.outputs) > 3 and node.outputs[3].uses():
        return "its output_qk output is read"
    for index in (_K_SCALE, _V_SCALE):
        scale = value_tracing.input_at(node, index)
        if scale is None or scale.const_value is None:
            return f"its input {index} (the scale) is not a constant"
    if node.attributes.get("num_heads") is None or node.attributes.get("kv_num_heads") is None:
        return "its head counts are not given"
    kv_heads = node.attributes["kv_num_heads"].as_int()
    past = value_tracing.input_at(node, _PAST_KEY)
    if past is None or value_tracing.gqa_head_size(node, past, kv_heads) is None:
        return "its head size is unknown"
    rotary = node.attributes.get("do_rotary")
    cos = value_tracing.input_at(node, _COS)
    if rotary is not None and rotary.as_int() == 1 and (cos is None or cos.shape is None or
                                                         not isinstance(cos.shape[-1], int)):
        return "its rotary cache has no known width"
    return None


class _Builder:
    """Nodes of one branch, each named under PREFIX and the wrapped node's name."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.nodes: list[ir.Node] = []

    def __call__(self, name: str, op: str, inputs: Sequence[ir.Value | None], *,
                 outputs: int = 1, domain: str = "", **attributes: Any) -> ir.Value:
        node = ir.node(op, inputs, attributes or None, domain=domain, num_outputs=outputs,
                       name=f"{self.tag}/{name}")
        for index, value in enumerate(node.outputs):
            value.name = f"{self.tag}/{name}" + (f":{index}" if outputs > 1 else "")
        self.nodes.append(node)
        return node.outputs[0]

    def outputs(self) -> list[ir.Value]:
        return list(self.nodes[-1].outputs)

    def constant(self, name: str, array: np.ndarray) -> ir.Value:
        return self(name, "Constant", [], value=ir.tensor(array))


def _wrap(graph: ir.Graph, node: ir.Node) -> None:
    tag = f"{PREFIX}{node.name}"
    main = _Builder(tag)
    rows = main("rows", "Shape", [node.inputs[_QUERY]], start=1, end=2)
    wide = main("wide", "GreaterOrEqual", [rows, main.constant("min_rows",
                                                               np.array([MIN_ROWS], np.int64))])
    condition = main("condition", "Squeeze", [wide])
    inverses = [_inverse(graph, node.inputs[index]) for index in (_K_SCALE, _V_SCALE)]
    float_graph = _float_branch(node, inverses, f"{tag}/float")
    wrapper = ir.node("If", [condition], {"then_branch": float_graph},
                      num_outputs=len(node.outputs), name=tag)
    graph.insert_before(node, [*main.nodes, wrapper])
    for new, old in zip(wrapper.outputs, node.outputs):
        name = old.name
        new.type, new.shape = old.type, old.shape
        old.name = f"{name}{_KERNEL}"
        new.name = name
    ir.convenience.replace_all_uses_with(list(node.outputs), list(wrapper.outputs),
                                         replace_graph_outputs=True)
    graph.remove(node)  # kept whole (inputs too): it moves into the else branch
    kernel_graph = ir.Graph([], list(node.outputs), nodes=[node], name=f"{tag}/kernel")
    wrapper.attributes["else_branch"] = ir.AttrGraph("else_branch", kernel_graph)


_KERNEL = "/kernel"


def _inverse(graph: ir.Graph, scale: ir.Value | None) -> ir.Value:
    """1 / scale in float32, as the kernel's quantizer computes it, as a main-graph
    initializer (shared by every node reading that scale)."""
    assert scale is not None and scale.const_value is not None and scale.name is not None
    name = f"{scale.name}{_INVERSE}"
    if name in graph.initializers:
        return graph.initializers[name]
    array = np.float32(1.0) / np.asarray(scale.const_value.numpy(), dtype=np.float32)
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(
        ir.DataType.FLOAT), const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def _float_branch(node: ir.Node, inverses: list[ir.Value], tag: str) -> ir.Graph:
    """The then branch of rule 3."""
    b = _Builder(tag)
    heads = node.attributes["num_heads"].as_int()
    kv_heads = node.attributes["kv_num_heads"].as_int()
    past_key = node.inputs[_PAST_KEY]
    assert past_key is not None
    size = value_tracing.gqa_head_size(node, past_key, kv_heads)
    assert size is not None
    bits = node.attributes["kv_cache_bit_width"].as_int()
    i64 = lambda *values: np.array(values, dtype=np.int64)  # noqa: E731
    query = node.inputs[_QUERY]
    key, value = value_tracing.input_at(node, _KEY), value_tracing.input_at(node, _VALUE)
    if key is None:
        b("split", "Split", [query, b.constant("split_sizes", i64(
            heads * size, kv_heads * size, kv_heads * size))], outputs=3, axis=-1)
        query, key, value = b.outputs()
    qs_index = query_seqlens_index()
    query_lens = value_tracing.input_at(node, qs_index) if qs_index is not None else None
    rows = b("rows", "Shape", [node.inputs[_QUERY]], start=1, end=2)
    one = b.constant("one", i64(1))
    totals = b("totals", "Add", [b("seqlens", "Cast", [node.inputs[_SEQLENS_K]],
                                   to=ir.DataType.INT64), one])
    real = rows if query_lens is None else b("query_lens", "Cast", [query_lens],
                                             to=ir.DataType.INT64)
    past = b("past", "Sub", [totals, real])
    steps = b("steps", "Range", [b.constant("zero_scalar", np.array(0, np.int64)),
                                 b("rows_scalar", "Squeeze", [rows]),
                                 b.constant("one_scalar", np.array(1, np.int64))])
    positions = b("positions", "Add", [b("past_column", "Unsqueeze", [past, one]), steps])
    end = b("end", "Add", [b("past_max", "ReduceMax", [past], keepdims=1), rows])
    # The attention's total length is its window's, whatever the node's own says (a capacity
    # when the mask or the graph is capacity-wide: ONNX Runtime refuses a total longer than
    # the past it is given).
    window_total = b("window_total", "Cast", [b("end_scalar", "Squeeze", [end])],
                     to=ir.DataType.INT32)
    indices = _scatter_indices(b, past, positions, rows, kv_heads)
    assert query is not None and key is not None and value is not None
    rotary = node.attributes.get("do_rotary")
    key_rows = key
    if rotary is not None and rotary.as_int() == 1:
        query, key_rows = (_rotary(b, name, rows_in, positions, node, count, size)
                           for name, rows_in, count in (("query_rotary", query, heads),
                                                        ("key_rotary", key, kv_heads)))
    attended = []
    presents = []
    for name, new, cache, scale, inverse in (
            ("key", key_rows, past_key, node.inputs[_K_SCALE], inverses[0]),
            ("value", value, node.inputs[_PAST_VALUE], node.inputs[_V_SCALE], inverses[1])):
        codes, stored = _quantize(b, name, new, inverse, kv_heads, size, bits)
        heads_first = b(f"{name}_dequantized", "Mul", [codes, scale])
        attended.append(b(f"{name}_rows", "Reshape", [
            b(f"{name}_rows_major", "Transpose", [heads_first], perm=[0, 2, 1, 3]),
            b.constant(f"{name}_row_shape", i64(0, 0, kv_heads * size))]))
        presents.append(b(f"{name}_present", "ScatterND", [cache, indices, stored]))
        window = b(f"{name}_past_codes", "Slice", [cache, b.constant(f"{name}_start", i64(0)),
                                                   end, b.constant(f"{name}_axis", i64(2))])
        attended.append(b(f"{name}_past", "Mul", [_dequantize(b, name, window, size, bits),
                                                   scale]))
    attributes = {name: attr for name, attr in node.attributes.items()
                  if name not in _QUANT_ATTRIBUTES}
    attributes["do_rotary"] = ir.AttrInt64("do_rotary", 0)
    inputs: list[ir.Value | None] = [query, attended[0], attended[2], attended[1], attended[3],
                                     node.inputs[_SEQLENS_K], window_total]
    if query_lens is not None and qs_index is not None:
        inputs += [None] * (qs_index - len(inputs)) + [query_lens]
    attention = ir.node("GroupQueryAttention", inputs, domain=value_tracing.MICROSOFT_DOMAIN,
                        num_outputs=3, name=f"{tag}/attention")
    for attr in attributes.values():
        attention.attributes[attr.name] = ir.Attr(attr.name, attr.type, attr.value)
    for index, suffix in enumerate(("output", "float_key", "float_value")):
        attention.outputs[index].name = f"{tag}/attention:{suffix}"
    b.nodes.append(attention)
    outputs = [attention.outputs[0], *presents]
    for new, old in zip(outputs, node.outputs):
        new.type = old.type
    return ir.Graph([], outputs, nodes=b.nodes, name=tag)


def _scatter_indices(b: _Builder, past: ir.Value, positions: ir.Value, rows: ir.Value,
                     kv_heads: int) -> ir.Value:
    """[B, kv_heads, S, 3] (batch, head, P_b + i): where ScatterND writes each new row."""
    i64 = lambda *values: np.array(values, dtype=np.int64)  # noqa: E731
    batch = b("batch", "Shape", [past])
    shape = b("index_shape", "Concat", [batch, b.constant("kv_heads", i64(kv_heads)), rows],
              axis=0)
    entries = b("entries", "Range", [b.constant("entries_start", np.array(0, np.int64)),
                                     b("batch_scalar", "Squeeze", [batch]),
                                     b.constant("entries_step", np.array(1, np.int64))])
    parts = [b("batch_index", "Unsqueeze", [entries, b.constant("batch_axes", i64(1, 2))]),
             b.constant("head_index", np.arange(kv_heads, dtype=np.int64).reshape(1, -1, 1)),
             b("row_index", "Unsqueeze", [positions, b.constant("row_axes", i64(1))])]
    last = b.constant("last_axis", i64(-1))
    columns = [b(f"{name}_column", "Unsqueeze", [b(f"{name}_full", "Expand", [part, shape]),
                                                 last])
               for name, part in zip(("batch", "head", "row"), parts)]
    return b("indices", "Concat", columns, axis=-1)


def _rotary(b: _Builder, name: str, rows: ir.Value, positions: ir.Value, node: ir.Node,
            heads: int, size: int) -> ir.Value:
    cos = node.inputs[_COS]
    assert cos is not None and cos.shape is not None
    attributes: dict[str, int] = {"num_heads": heads}
    interleaved = node.attributes.get("rotary_interleaved")
    attributes["interleaved"] = interleaved.as_int() if interleaved is not None else 0
    width = cos.shape[-1]
    assert isinstance(width, int)
    if 2 * width != size:
        attributes["rotary_embedding_dim"] = 2 * width
    return b(name, "RotaryEmbedding", [rows, positions, cos, node.inputs[_SIN]],
             domain=value_tracing.MICROSOFT_DOMAIN, **attributes)


def _quantize(b: _Builder, name: str, rows: ir.Value, inverse: ir.Value, kv_heads: int,
              size: int, bits: int) -> tuple[ir.Value, ir.Value]:
    """The codes of new rows [B, kv_heads, S, size] as float32, and as the cache stores them."""
    i64 = lambda *values: np.array(values, dtype=np.int64)  # noqa: E731
    heads_first = b(f"{name}_heads_first", "Transpose", [
        b(f"{name}_split_heads", "Reshape", [rows, b.constant(
            f"{name}_head_shape", i64(0, 0, kv_heads, size))])], perm=[0, 2, 1, 3])
    low, high = (-128.0, 127.0) if bits == 8 else (-8.0, 7.0)
    codes = b(f"{name}_codes", "Clip", [
        b(f"{name}_rounded", "Round", [b(f"{name}_scaled", "Mul", [heads_first, inverse])]),
        b.constant(f"{name}_low", np.array(low, np.float32)),
        b.constant(f"{name}_high", np.array(high, np.float32))])
    if bits == 8:
        return codes, b(f"{name}_int8", "Cast", [codes], to=ir.DataType.INT8)
    biased = b(f"{name}_biased", "Cast", [b(f"{name}_plus_8", "Add", [
        codes, b.constant(f"{name}_bias", np.array(8.0, np.float32))])], to=ir.DataType.UINT8)
    pairs = b(f"{name}_pairs", "Reshape", [biased, b.constant(
        f"{name}_pair_shape", i64(0, 0, 0, size // 2, 2))])
    b(f"{name}_halves", "Split", [pairs, b.constant(f"{name}_halve_sizes", i64(1, 1))],
      outputs=2, axis=-1)
    even, odd = b.outputs()
    packed = b(f"{name}_packed", "Add", [even, b(f"{name}_odd_high", "Mul", [
        odd, b.constant(f"{name}_sixteen", np.array(16, np.uint8))])])
    return codes, b(f"{name}_int4", "Squeeze", [packed, b.constant(f"{name}_pair_axis",
                                                                   i64(-1))])


def _dequantize(b: _Builder, name: str, stored: ir.Value, size: int, bits: int) -> ir.Value:
    """The float32 codes of cache rows as stored (int8, or uint8 holding two 4-bit values)."""
    if bits == 8:
        return b(f"{name}_past_float", "Cast", [stored], to=ir.DataType.FLOAT)
    i64 = lambda *values: np.array(values, dtype=np.int64)  # noqa: E731
    last = b.constant(f"{name}_past_last", i64(-1))
    even = b(f"{name}_past_even", "BitwiseAnd", [stored, b.constant(
        f"{name}_past_mask", np.array(15, np.uint8))])
    odd = b(f"{name}_past_odd", "BitShift", [stored, b.constant(
        f"{name}_past_shift", np.array(4, np.uint8))], direction="RIGHT")
    pairs = b(f"{name}_past_pairs", "Concat", [
        b(f"{name}_past_even_column", "Unsqueeze", [even, last]),
        b(f"{name}_past_odd_column", "Unsqueeze", [odd, last])], axis=-1)
    nibbles = b(f"{name}_past_nibbles", "Reshape", [pairs, b.constant(
        f"{name}_past_shape", i64(0, 0, 0, size))])
    return b(f"{name}_past_float", "Sub", [
        b(f"{name}_past_biased", "Cast", [nibbles], to=ir.DataType.FLOAT),
        b.constant(f"{name}_past_bias", np.array(8.0, np.float32))])


def _clear_inputs(node: ir.Node) -> None:
    for index in range(len(node.inputs)):
        node.replace_input_with(index, None)


def _detach(graph: ir.Graph) -> None:
    """Drop the uses `graph`'s nodes hold on outer values, so the graph can be discarded."""
    for node in ir.traversal.RecursiveGraphIterator(graph):
        _clear_inputs(node)
