"""Mark the KV inputs of GroupQueryAttention (or opset 24 TensorScatter) as bound at capacity."""

from __future__ import annotations

import logging

import onnx_ir as ir

from onnx_chunk.graph import chunk_plan, metadata
from onnx_chunk.passes import value_tracing

logger = logging.getLogger(__name__)

# GroupQueryAttention's past inputs and the present outputs that share their buffers.
_PAST_TO_PRESENT = ((3, 1, "past_key"), (4, 2, "past_value"))
# A standard TensorScatter writes the new rows into its past_cache and returns it.
_SCATTER_PAST_TO_PRESENT = ((0, 0, "past_cache"),)
_GQA_QUERY_INPUT = 0
_GQA_KEY_INPUT = 1
_GQA_COS_CACHE_INPUT = 7
_ROTARY_COS_CACHE_INPUT = 2
# BNSH: [batch, kv_heads, sequence, head]; the sequence axis is the capacity axis.
_KV_RANK = 4
CAPACITY_AXIS = 2
_HEAD_AXIS = 3


class KVCapacityPass(ir.passes.InPlacePass):
    """Record which graph inputs are GQA KV buffers bound at full capacity.

    GroupQueryAttention keeps capacity and length apart: past_key/past_value (inputs 3 and 4)
    are bound at the physical capacity for the whole generation while the real length travels
    in seqlens_k (input 5) and total_sequence_length (input 6). So the KV shape never changes
    and no kernel is recompiled as the cache fills.

    Rules:
    1. Every `com.microsoft::GroupQueryAttention` node's inputs 3 and 4 are followed back
       through Identity/Cast to a graph input; that input is bound at capacity on axis 2.
    2. The node's outputs 1 and 2 (present_key/present_value) are followed forward through
       Identity/Cast to graph outputs; the first one found shares the past input's buffer.
    3. A past that does not come from a graph input, a present that reaches no graph output,
       or a present whose dtype, rank or non-sequence axes differ from its past is not bound
       (no binding is recorded, since the runtime must bind the past's buffer as the present
       output to bind it at capacity): it is recorded as a problem with the reason, never
       guessed.
    4. The rows of the cos_cache initializer (GQA input 7, or input 2 of a
       `com.microsoft::RotaryEmbedding` when rotary runs outside GQA) are the longest sequence
       the model supports, the runtime's default capacity; when nodes disagree the smallest
       wins. Without any (rotary outside GQA, as the concat-KV rewrite leaves it), the
       length the rewrite recorded (config.json's max_position_embeddings) is used.
    5. A model without GQA gets zero nodes and no bindings; the pass still records that.
       A standard `TensorScatter` (opset 24, what `convert --kv-cache onnx24` writes) binds
       its input 0 to its output 0 by rules 1-3, KV heads from the past's axis 1; it is no
       GQA node.
    6. Each binding records the sizes of the head axes: kv_heads from the node's
       `kv_num_heads`, the head size from the past or present shape when fixed, else from the
       width of the K projection (packed QKV: the query width over heads + 2 x kv_heads); and
       the window of a window-sized cache (`sliding_window_cache=1`, `local_window_size`).
    7. The findings go to the inference metadata; the pass reports a modification only when
       they differ from what is stored.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        findings = find_kv_capacity(model)
        modified = metadata.write_kv_capacity(model, findings)
        if modified:
            logger.info("KV capacity: %d GQA nodes, %d capacity inputs, %d problems",
                        findings.gqa_nodes, len(findings.bindings), len(findings.problems))
        return ir.passes.PassResult(model, modified=modified)


def find_kv_capacity(model: ir.Model) -> chunk_plan.KVCapacityFindings:
    """What the pass records, computed without touching the model."""
    nodes = value_tracing.gqa_nodes(model.graph)
    graph_inputs = {id(value) for value in model.graph.inputs}
    bindings: list[chunk_plan.KVBinding] = []
    problems: list[str] = []
    lengths: list[int] = []
    for index, (node, pairs) in enumerate(_kv_cache_nodes(model.graph)):
        label = f"{node.op_type} node {node.name or f'#{index}'!r}"
        for past_index, present_index, role in pairs:
            binding = _bind(label, node, past_index, present_index, role, graph_inputs, problems)
            if binding is not None:
                bindings.append(binding)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        length = _cos_cache_rows(node)
        if length is not None:
            lengths.append(length)
    return chunk_plan.KVCapacityFindings(
        gqa_nodes=len(nodes),
        bindings=tuple(bindings),
        max_sequence_length=min(lengths) if lengths else metadata.read_max_positions(model),
        problems=tuple(problems),
    )


def _bind(
    label: str,
    node: ir.Node,
    past_index: int,
    present_index: int,
    role: str,
    graph_inputs: set[int],
    problems: list[str],
) -> chunk_plan.KVBinding | None:
    past = value_tracing.input_at(node, past_index)
    if past is None:
        problems.append(f"{label} has no {role} (input {past_index}), so it keeps no KV cache "
                        "that could be bound at capacity")
        return None
    origin = value_tracing.source(past)
    if id(origin) not in graph_inputs:
        producer = origin.producer()
        where = (f"the output of {producer.op_type} node {producer.name!r}"
                 if producer is not None
                 else "an initializer" if origin.is_initializer() else "inside the graph")
        problems.append(f"{label}: {role} (input {past_index}) {origin.name!r} comes from "
                        f"{where}, not from a graph input, so it cannot be bound at capacity")
        return None
    shape = origin.shape
    if shape is None or len(shape) != _KV_RANK:
        problems.append(f"{label}: {role} input {origin.name!r} has shape "
                        f"{value_tracing.shape_text(shape)}, expected rank 4 "
                        "[batch, kv_heads, sequence, head]")
        return None
    present = node.outputs[present_index] if present_index < len(node.outputs) else None
    outputs = value_tracing.graph_outputs_fed_by(present) if present is not None else []
    if not outputs:
        problems.append(f"{label}: present for {role} (output {present_index}) reaches no graph "
                        f"output, so {origin.name!r} has no buffer to share with it and "
                        "cannot be bound at capacity")
        return None
    output = outputs[0]
    mismatch = _shape_mismatch(origin, output)
    if mismatch:
        problems.append(f"{label}: present {output.name!r} cannot share the buffer of "
                        f"{origin.name!r}: {mismatch}")
        return None
    kv_heads = _int_attribute(node, "kv_num_heads")
    if kv_heads is None and isinstance(heads_dim := shape[1], int):
        kv_heads = heads_dim
    return chunk_plan.KVBinding(input=value_tracing.name_of(origin),
                              output=value_tracing.name_of(output), capacity_axis=CAPACITY_AXIS,
                              kv_heads=kv_heads, head_size=_head_size(node, origin, output),
                              window=_cache_window(node))


def _int_attribute(node: ir.Node, name: str) -> int | None:
    attribute = node.attributes.get(name)
    return None if attribute is None else int(attribute.as_int())


def _head_size(node: ir.Node, past: ir.Value, present: ir.Value) -> int | None:
    """The KV head size: declared on the past or present, else the width of K (or packed QKV)."""
    for value in (past, present):
        if value.shape is not None and isinstance(dim := value.shape[_HEAD_AXIS], int):
            return dim
    kv_heads = _int_attribute(node, "kv_num_heads")
    heads = _int_attribute(node, "num_heads")
    if not kv_heads or not heads:
        return None
    key = value_tracing.input_at(node, _GQA_KEY_INPUT)
    width = value_tracing.last_dim(key) if key is not None else None
    if width is not None:
        return width // kv_heads if width % kv_heads == 0 else None
    # Packed QKV: the query input carries heads + 2 * kv_heads heads.
    packed = value_tracing.last_dim(value_tracing.input_at(node, _GQA_QUERY_INPUT))
    per_token_heads = heads + 2 * kv_heads
    if packed is None or packed % per_token_heads:
        return None
    return packed // per_token_heads


def _cache_window(node: ir.Node) -> int | None:
    """`local_window_size` when the node's KV buffers are window-sized, else None."""
    if not _int_attribute(node, "sliding_window_cache"):
        return None
    window = _int_attribute(node, "local_window_size")
    return window if window is not None and window > 0 else None


def _shape_mismatch(past: ir.Value, present: ir.Value) -> str:
    """Why `present` cannot alias `past`, or an empty string when it can."""
    if past.dtype != present.dtype:
        return f"dtype {present.dtype} differs from {past.dtype}"
    past_shape, present_shape = past.shape, present.shape
    if past_shape is None or present_shape is None or len(present_shape) != len(past_shape):
        return (f"shape {value_tracing.shape_text(present_shape)} differs in rank from "
                f"{value_tracing.shape_text(past_shape)}")
    for axis, (a, b) in enumerate(zip(past_shape, present_shape)):
        key_a, key_b = value_tracing.dim_key(a), value_tracing.dim_key(b)
        if axis == CAPACITY_AXIS:
            # The sequence axis is named differently (past vs total length) in exports that
            # share the buffer; only two different fixed sizes are a real conflict.
            conflict = isinstance(key_a, int) and isinstance(key_b, int) and key_a != key_b
        else:
            conflict = key_a != key_b
        if conflict:
            return (f"shape {value_tracing.shape_text(present_shape)} differs from "
                    f"{value_tracing.shape_text(past_shape)} on axis {axis}")
    return ""


def _cos_cache_rows(node: ir.Node) -> int | None:
    if value_tracing.is_gqa(node):
        index = _GQA_COS_CACHE_INPUT
    elif node.op_type == "RotaryEmbedding" and node.domain == value_tracing.MICROSOFT_DOMAIN:
        index = _ROTARY_COS_CACHE_INPUT
    else:
        return None
    cos_cache = value_tracing.input_at(node, index)
    if cos_cache is None:
        return None
    origin = value_tracing.source(cos_cache)
    tensor = origin.const_value
    shape = tensor.shape if tensor is not None else origin.shape
    if shape is None or len(shape) == 0 or not isinstance(shape[0], int):
        return None
    return shape[0]


def _kv_cache_nodes(graph: ir.Graph) -> list[tuple[ir.Node, tuple[tuple[int, int, str], ...]]]:
    """GroupQueryAttention and TensorScatter nodes, each with its (past, present, role) pairs."""
    found: list[tuple[ir.Node, tuple[tuple[int, int, str], ...]]] = []
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if value_tracing.is_gqa(node):
            found.append((node, _PAST_TO_PRESENT))
        elif value_tracing.is_tensor_scatter(node):
            found.append((node, _SCATTER_PAST_TO_PRESENT))
    return found


def kv_past_inputs(graph: ir.Graph) -> set[str]:
    """Names of the graph inputs that a GroupQueryAttention or TensorScatter reads as past."""
    graph_inputs = {id(value) for value in graph.inputs}
    names: set[str] = set()
    for node, pairs in _kv_cache_nodes(graph):
        for past_index, _, _ in pairs:
            past = value_tracing.input_at(node, past_index)
            if past is not None and id(origin := value_tracing.source(past)) in graph_inputs:
                names.add(value_tracing.name_of(origin))
    return names


def kv_present_outputs(graph: ir.Graph) -> set[str]:
    """Names of the graph outputs that GroupQueryAttention or TensorScatter presents reach."""
    names: set[str] = set()
    for node, pairs in _kv_cache_nodes(graph):
        for _, present_index, _ in pairs:
            if present_index < len(node.outputs):
                names.update(value_tracing.name_of(output)
                             for output in value_tracing.graph_outputs_fed_by(
                                 node.outputs[present_index]))
    return names
