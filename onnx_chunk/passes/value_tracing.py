"""Following values through nodes that pass a tensor on unchanged in layout (Identity, Cast)."""

from __future__ import annotations

import onnx_ir as ir

MICROSOFT_DOMAIN = "com.microsoft"
GQA_OP = "GroupQueryAttention"
TENSOR_SCATTER_OP = "TensorScatter"
# The nodes passes.kv_prefill adds are named under this prefix; its float attention reads a
# dequantized copy, no cache of its own, so it is no KV cache's GroupQueryAttention.
KV_PREFILL_PREFIX = "onnx_chunk/kv_prefill/"

# Nodes whose output is their first input with the same shape: a KV buffer or a state tensor
# keeps its identity through them.
_PASS_THROUGH_OPS = frozenset({"Identity", "Cast", "CastLike"})


def is_gqa(node: ir.Node) -> bool:
    """Whether `node` is a `com.microsoft::GroupQueryAttention`."""
    return node.op_type == GQA_OP and node.domain == MICROSOFT_DOMAIN


def is_tensor_scatter(node: ir.Node) -> bool:
    """Whether `node` is the standard `TensorScatter` (opset 24), a KV write at capacity."""
    return node.op_type == TENSOR_SCATTER_OP and node.domain in ("", "ai.onnx")


def gqa_nodes(graph: ir.Graph) -> list[ir.Node]:
    """Every GroupQueryAttention node of `graph` and its subgraphs, in graph order, but the
    float attention of a quantized cache's prefill (passes.kv_prefill)."""
    return [node for node in ir.traversal.RecursiveGraphIterator(graph)
            if is_gqa(node) and not (node.name or "").startswith(KV_PREFILL_PREFIX)]


def tensor_scatter_nodes(graph: ir.Graph) -> list[ir.Node]:
    """Every standard TensorScatter node of `graph` and its subgraphs, in graph order."""
    return [node for node in ir.traversal.RecursiveGraphIterator(graph)
            if is_tensor_scatter(node)]


def _passes_through(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type in _PASS_THROUGH_OPS


def input_at(node: ir.Node, index: int) -> ir.Value | None:
    """The node's input `index`, or None when it is absent or left empty."""
    return node.inputs[index] if index < len(node.inputs) else None


def name_of(value: ir.Value) -> str:
    """The name of `value`, a graph input or output or a node output (onnx_ir names those)."""
    name = value.name
    assert name is not None, "onnx_ir names every value of a graph"
    return name


def source(value: ir.Value) -> ir.Value:
    """Walk back from `value` through pass-through nodes to where it is made or fed."""
    while (producer := value.producer()) is not None and _passes_through(producer):
        upstream = producer.inputs[0]
        if upstream is None:
            break
        value = upstream
    return value


def graph_outputs_fed_by(value: ir.Value) -> list[ir.Value]:
    """The graph outputs that are `value` itself or reached from it through pass-through nodes."""
    found: list[ir.Value] = []
    pending = [value]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if current.is_graph_output():
            found.append(current)
        for consumer in current.consumers():
            if _passes_through(consumer):
                pending.extend(output for output in consumer.outputs)
    return found


def same_dims(first: ir.Shape | None, second: ir.Shape | None) -> bool:
    """Whether two shapes are known and equal axis by axis (symbolic names compared by name)."""
    if first is None or second is None or len(first) != len(second):
        return False
    return all(dim_key(a) == dim_key(b) for a, b in zip(first, second))


def dim_key(dim: int | ir.SymbolicDim) -> int | str | None:
    """A comparable key for one dimension: its size or its symbolic name (None when unnamed)."""
    if isinstance(dim, int):
        return dim
    return dim.value


def shape_text(shape: ir.Shape | None) -> str:
    """A shape as `[batch_size, 4, sequence_length]`, or `unknown`."""
    if shape is None:
        return "unknown"
    return "[" + ", ".join("?" if dim_key(dim) is None else str(dim_key(dim))
                           for dim in shape) + "]"


# Ops whose output keeps the last axis of their first input (elementwise, normalisations,
# activations): a projection's width survives them.
_WIDTH_KEEPING_OPS = frozenset({
    "Identity", "Cast", "CastLike", "Relu", "Sigmoid", "Tanh", "Gelu", "Neg",
    "SimplifiedLayerNormalization", "LayerNormalization", "RMSNormalization",
    "SkipSimplifiedLayerNormalization", "SkipLayerNormalization", "QuickGelu", "FastGelu",
})
_BROADCASTING_OPS = frozenset({"Add", "Sub", "Mul", "Div"})
_QUANTIZED_MATMUL = "MatMulNBits"
_MAX_TRACE_DEPTH = 12


def last_dim(value: ir.Value | None, depth: int = 0) -> int | None:
    """The size of `value`'s last axis, from its declared shape or the nodes that make it.

    Followed back through projections (MatMul by a constant weight, MatMulNBits' N, a bias
    added), width-keeping ops and Reshapes to a constant shape; None when nothing fixes it.
    """
    if value is None or depth > _MAX_TRACE_DEPTH:
        return None
    if value.shape is not None and len(value.shape) > 0 and isinstance(value.shape[-1], int):
        return int(value.shape[-1])
    tensor = value.const_value
    if tensor is not None and len(tensor.shape) > 0:
        return int(tensor.shape.numpy()[-1])
    producer = value.producer()
    if producer is None:
        return None
    op = producer.op_type
    if op == _QUANTIZED_MATMUL:
        width = producer.attributes.get("N")
        return None if width is None else int(width.as_int())
    if op == "MatMul" and len(producer.inputs) > 1:
        return last_dim(producer.inputs[1], depth + 1)
    if op in _BROADCASTING_OPS:
        widths = [last_dim(operand, depth + 1) for operand in producer.inputs]
        known = [width for width in widths if width is not None and width != 1]
        return max(known) if known else None
    if op == "Reshape" and len(producer.inputs) > 1:
        shape = producer.inputs[1].const_value if producer.inputs[1] is not None else None
        if shape is not None:
            dims = shape.numpy().reshape(-1).tolist()
            if dims and dims[-1] > 0:
                return int(dims[-1])
        return None
    if op in _WIDTH_KEEPING_OPS and producer.inputs:
        return last_dim(producer.inputs[0], depth + 1)
    return None


def gqa_head_size(node: ir.Node, past: ir.Value, kv_heads: int) -> int | None:
    """The float head size: GQA's key width over kv_heads (packed QKV: the query width over
    heads + 2 x kv_heads); the past's head axis when those are unknown and it is not packed."""
    heads = node.attributes.get("num_heads")
    key = input_at(node, 1)
    width = last_dim(key) if key is not None else None
    if width is not None and kv_heads and width % kv_heads == 0:
        return width // kv_heads
    packed = last_dim(input_at(node, 0))
    if key is None and packed is not None and heads is not None and kv_heads:
        per_token = int(heads.as_int()) + 2 * kv_heads
        return packed // per_token if packed % per_token == 0 else None
    bits = node.attributes.get("kv_cache_bit_width")
    declared = past.shape[3] if past.shape is not None else None
    if isinstance(declared, int) and not (bits is not None and bits.as_int() == 4):
        return declared
    return None
