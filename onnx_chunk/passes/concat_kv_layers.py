"""Find the concat-KV attention layers of a standard-ONNX decoder (ConcatKVToGQAPass rules 1-5).

Optimum and torch.onnx exports grow the cache: `present = Concat(past, new)`, repeated to the
query heads, then either spelled-out attention (MatMul, Softmax, MatMul) or opset 23's
`Attention`. Each form is one onnxscript rewriter pattern (`_RULES`) that spans the KV Concat,
the head repeat and the attention, its optional steps (scales, mask Add, NaN guard) as
or-patterns. What a pattern cannot say is checked in plain onnx_ir on the match: that nothing
outside it reads its data (Shape reads allowed), the mask's inputs, the head counts, the
Attention settings; and for a layer no pattern matches, the node where the closest match
stopped, which the refusal names. The rule numbers are ConcatKVToGQAPass's
(concat_kv_attention).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_chunk.passes import value_tracing

MASK_INPUT = "attention_mask"
# Nodes that read only a tensor's shape, never its values.
_SHAPE_OPS = frozenset({"Shape", "Size"})
# Every op the attention patterns below are made of.
_PATTERN_OPS = frozenset({"Concat", "Unsqueeze", "Expand", "Reshape", "Tile", "Transpose",
                          "Mul", "Div", "MatMul", "Add", "Softmax", "IsNaN", "Where",
                          "Attention"})
KV_RANK = 4
_KEY_TRANSPOSED = (0, 1, 3, 2)
_PROJECTION_SEARCH = 64
# The opset 23 Attention's inputs that carry its own KV cache, and its optional outputs.
_ATTENTION_PAST_INPUTS = (4, 5, 6)
_ATTENTION_MASK_INPUT = 3
FORM_SOFTMAX = "MatMul+Softmax"
FORM_ATTENTION = "Attention"


@dataclasses.dataclass(frozen=True)
class ConcatKVLayer:
    """One attention layer of a concat-KV decoder, by value names.

    `query` is [batch, heads, rows, head] as the attention reads it (rotary applied), `new_key`
    and `new_value` the rows Concat appends to the past, `output` the attention's result in
    [batch, heads, rows, head]; `anchor` names the Attention or Softmax node.
    """

    past_key: str
    past_value: str
    present_key: str
    present_value: str
    query: str
    new_key: str
    new_value: str
    output: str
    form: str
    anchor: str
    num_heads: int
    kv_num_heads: int
    head_size: int
    scale: float


@dataclasses.dataclass(frozen=True)
class ConcatKVFindings:
    """The concat-KV layers found, or why the model cannot be rewritten (`refusal`)."""

    layers: tuple[ConcatKVLayer, ...]
    refusal: str | None

    @property
    def concat_kv(self) -> bool:
        """Whether the model grows its KV by Concat (rewritable or not)."""
        return bool(self.layers) or self.refusal is not None

    def summary(self) -> list[str]:
        """The findings as short lines for a terminal."""
        if not self.concat_kv:
            return []
        if self.refusal is not None:
            return [f"concat KV: not rewritable: {self.refusal}"]
        forms = sorted({layer.form for layer in self.layers})
        first = self.layers[0]
        return [f"concat KV: {len(self.layers)} layers ({', '.join(forms)}; heads "
                f"{first.num_heads}, KV heads {first.kv_num_heads}, head size "
                f"{first.head_size}, scale {first.scale:g}); `convert` rewrites them to "
                "com.microsoft::GroupQueryAttention at capacity, rotary kept outside "
                "(--kv-cache onnx24: TensorScatter + Attention)"]


class _Refusal(Exception):
    """A layer that does not match; the message names the node."""


def find_concat_kv_attention(graph: ir.Graph) -> ConcatKVFindings:
    """What the concat-KV rewrite would rewrite, computed without touching the graph."""
    concats = _kv_concats(graph)
    if not concats:
        return ConcatKVFindings((), None)
    try:
        if MASK_INPUT not in {value.name for value in graph.inputs}:
            raise _Refusal(f"the graph has no {MASK_INPUT!r} input to derive seqlens_k from")
        matches, closest = [], None
        for node in graph:
            for form, rule in _RULES:
                # The matcher reads only the graph; the finder has no model to give it. The
                # nodes stay in place, so their removability is not asked (rule 1 instead).
                match = rule.match(None, graph, node, check_nodes_are_removable=False)
                if match:
                    matches.append((form, node, match))
                elif match is not None and match.num_matched_nodes() > 1 and (
                        closest is None
                        or match.num_matched_nodes() > closest.num_matched_nodes()):
                    closest = match
        layers = {layer.present_key: layer
                  for layer in (_layer(form, node, match, graph)
                                for form, node, match in matches)}
        claimed = {name for layer in layers.values()
                   for name in (layer.present_key, layer.present_value)}
        stray = [present for present in concats if present.name not in claimed]
        if stray:
            raise _Refusal(_why_unmatched(stray[0], closest))
    except _Refusal as refusal:
        return ConcatKVFindings((), str(refusal))
    return ConcatKVFindings(tuple(layers[present.name] for present in concats
                                  if present.name in layers), None)


def grows_kv_by_concat(graph: ir.Graph) -> bool:
    """Whether the graph grows its KV by Concat, rewritable or not (`ConcatKVFindings.
    concat_kv`), told by its present outputs alone, without matching the attention."""
    return bool(_kv_concats(graph))


def _kv_concats(graph: ir.Graph) -> list[ir.Value]:
    inputs = {id(value) for value in graph.inputs}
    return [output for output in graph.outputs if _is_kv_concat(output, inputs)]


def _is_kv_concat(output: ir.Value, inputs: set[int]) -> bool:
    node = output.producer()
    if node is None or node.op_type != "Concat" or len(node.inputs) != 2:
        return False
    past = node.inputs[0]
    return (past is not None and id(past) in inputs and past.shape is not None
            and len(past.shape) == KV_RANK)


def label(node: ir.Node) -> str:
    """The node as a refusal names it: `Concat node 'name'`."""
    return f"{node.op_type} node {node.name!r}"


def _repeated(op, present):
    """transformers' repeat_kv as exported (Unsqueeze, Expand, Reshape), a Tile, or none."""
    return pattern.OrValue([
        op.Reshape(op.Expand(op.Unsqueeze(present, _allow_other_inputs=True),
                             _allow_other_inputs=True), _allow_other_inputs=True),
        op.Tile(present, _allow_other_inputs=True),
        present])


def _scaled(op, value, factor, tag: str):
    """`value`, or `value` times or divided by `factor`; `tag` binds which."""
    return pattern.OrValue(
        [op.Mul(value, factor), op.Mul(factor, value), op.Div(value, factor), value],
        tag_var=tag, tag_values=("Mul", "Mul", "Div", None))


def _grown_kv(op, past_key, new_key, past_value, new_value):
    return (_repeated(op, op.Concat(past_key, new_key, _outputs=["present_key"])),
            _repeated(op, op.Concat(past_value, new_value, _outputs=["present_value"])))


def _softmax_attention(op, query, past_key, new_key, past_value, new_value, mask,
                       query_scale, key_scale, scores_scale, masked_scale, zero):
    key, value = _grown_kv(op, past_key, new_key, past_value, new_value)
    key_transposed = op.Transpose(key, perm=list(_KEY_TRANSPOSED))
    scores = op.MatMul(_scaled(op, query, query_scale, "query_op"),
                       _scaled(op, key_transposed, key_scale, "key_op"))
    scaled = _scaled(op, scores, scores_scale, "scores_op")
    masked = pattern.OrValue([op.Add(scaled, mask), op.Add(mask, scaled), scaled])
    weights = op.Softmax(_scaled(op, masked, masked_scale, "masked_op"),
                         _outputs=["weights"])
    guarded = pattern.OrValue([op.Where(op.IsNaN(weights), zero, weights), weights])
    return op.MatMul(guarded, value)


def _attention_op(op, query, past_key, new_key, past_value, new_value):
    key, value = _grown_kv(op, past_key, new_key, past_value, new_value)
    return op.Attention(query, key, value, _allow_other_inputs=True)


def _past_is_kv_input(context, past_key, past_value, **_) -> bool:
    """Both pasts are rank-4 graph inputs, as `_is_kv_concat` anchors them."""
    inputs = {id(value) for value in context.graph_or_function.inputs}
    return all(id(past) in inputs and past.shape is not None and len(past.shape) == KV_RANK
               for past in (past_key, past_value))


_RULES = (
    (FORM_SOFTMAX, pattern.Pattern(_softmax_attention, _past_is_kv_input, name=FORM_SOFTMAX)),
    (FORM_ATTENTION, pattern.Pattern(_attention_op, _past_is_kv_input, name=FORM_ATTENTION)),
)


def _why_unmatched(present: ir.Value, closest: pattern.MatchResult | None) -> str:
    """Name the node where the match that got furthest stopped: a producer the patterns have
    no step for, else the node that failed."""
    nodes = [] if closest is None else [
        item for item in closest.failure_nodes_and_values if isinstance(item, ir.Node)]
    if closest is None or not nodes:
        return (f"the KV output {present.name!r} reaches no attention that the concat-KV "
                "patterns (MatMul+Softmax, Attention) match")
    failed = nodes[-1]
    foreign = [producer for item in failed.inputs if item is not None
               and (producer := item.producer()) is not None
               and producer.op_type not in _PATTERN_OPS]
    culprit = f"{label(foreign[0])} feeding {label(failed)}" if foreign else label(failed)
    return (f"{culprit} does not fit the concat-KV attention patterns (KV Concat, head "
            "repeat, scalar scales, one mask Add, Softmax or Attention); the closest match "
            f"stopped there ({closest.reason.rstrip('.')})")


def _layer(form: str, root: ir.Node, match: pattern.MatchResult,
           graph: ir.Graph) -> ConcatKVLayer:
    """Check a structural match (rules 1-4) and describe its layer."""
    found = match.bindings
    _check_single_use(match.nodes, root)
    if form == FORM_ATTENTION:
        anchor, query, (mask, scale) = root, found["query"], _attention_settings(root)
    else:
        anchor, mask = found["weights"].producer(), found["mask"]
        query, scale = _softmax_query_and_scale(match)
    if mask is not None:
        _check_mask(mask, graph)
    past_key, present_key, present_value = (found["past_key"], found["present_key"],
                                            found["present_value"])
    kv_heads, head_size = _kv_dims(past_key)
    heads = _query_heads(query, head_size)
    if heads % kv_heads:
        raise _Refusal(f"{heads} query heads are no multiple of {kv_heads} KV heads at "
                       f"{label(anchor)}")
    return ConcatKVLayer(
        past_key=past_key.name, past_value=found["past_value"].name,
        present_key=present_key.name, present_value=present_value.name,
        query=query.name, new_key=found["new_key"].name,
        new_value=found["new_value"].name, output=value_tracing.name_of(root.outputs[0]), form=form,
        anchor=anchor.name or "", num_heads=heads, kv_num_heads=kv_heads,
        head_size=head_size, scale=scale if scale is not None else 1.0 / math.sqrt(head_size))


def _check_single_use(nodes, root: ir.Node) -> None:
    """Rule 1: between the Concat and the attention's output nothing else reads the data."""
    matched = set(map(id, nodes))
    for node in nodes:
        if node is root:
            continue
        for output in node.outputs:
            others = [consumer for consumer in output.consumers()
                      if id(consumer) not in matched and consumer.op_type not in _SHAPE_OPS]
            if others:
                raise _Refusal(f"{output.name!r} of the attention also feeds "
                               f"{label(others[0])}; it must feed only the attention")


def _attention_settings(node: ir.Node) -> tuple[ir.Value | None, float | None]:
    """Rule 2 for opset 23's Attention: its mask and scale, or why it is refused."""
    carried = [index for index in _ATTENTION_PAST_INPUTS
               if value_tracing.input_at(node, index) is not None]
    if carried:
        raise _Refusal(f"{label(node)} carries its own KV cache (inputs {carried})")
    if any(output.uses() for output in node.outputs[1:]):
        raise _Refusal(f"{label(node)}'s present or score outputs are used")
    softcap = node.attributes.get("softcap")
    if softcap is not None and softcap.as_float() != 0.0:
        raise _Refusal(f"{label(node)} has softcap {softcap.as_float()}")
    query = node.inputs[0]
    assert query is not None, "the Attention pattern matched its query"
    if query.shape is not None and len(query.shape) != KV_RANK:
        raise _Refusal(f"{label(node)} reads a rank-{len(query.shape)} query; only the "
                       "4D (batch, heads, rows, head) form is rewritten")
    mask = value_tracing.input_at(node, _ATTENTION_MASK_INPUT)
    causal = node.attributes.get("is_causal")
    if mask is None and (causal is None or not causal.as_int()):
        raise _Refusal(f"{label(node)} has neither a mask nor is_causal: not a decoder's "
                       "causal attention")
    scale = node.attributes.get("scale")
    return mask, None if scale is None else scale.as_float()


def _softmax_query_and_scale(match: pattern.MatchResult) -> tuple[ir.Value, float]:
    """Rule 2 for the spelled-out form: Softmax on the key axis, a zero in the NaN guard, the
    query, and the product of the scalar factors on Q, Kᵀ and the scores. A Mul or Div of Q by
    anything but a constant scalar is part of the query, not of the scale."""
    found, nodes = match.bindings, match.nodes
    softmax = found["weights"].producer()
    axis = softmax.attributes.get("axis")
    if axis is not None and axis.as_int() not in (-1, KV_RANK - 1):
        raise _Refusal(f"{label(softmax)} normalises axis {axis.as_int()}, not the key axis")
    zero = found["zero"]
    if zero is not None and scalar(zero) != 0.0:
        where = next(node for node in nodes if node.op_type == "Where")
        raise _Refusal(f"{label(where)} after Softmax is not the Where(IsNaN(p), 0, p) guard")
    query, factor = found["query"], 1.0
    for tag, name in (("query_op", "query_scale"), ("key_op", "key_scale"),
                      ("scores_op", "scores_scale"), ("masked_op", "masked_scale")):
        if found[tag] is None:
            continue
        node = next(node for node in nodes if node.op_type == found[tag]
                    and found[name] in node.inputs)
        step = _scale_factor(node)
        if step is None and tag == "query_op":
            query = node.outputs[0]
        elif step is None:
            raise _Refusal(f"{label(node)} in the attention scores does not scale by a "
                           "non-zero scalar constant")
        else:
            factor *= step
    return query, factor


def _scale_factor(node: ir.Node) -> float | None:
    """The factor a Mul by a scalar constant (either side) or a Div by one applies."""
    if node.op_type == "Mul":
        return next((step for step in map(scalar, node.inputs) if step is not None), None)
    divisor = scalar(node.inputs[1])
    return 1.0 / divisor if divisor else None


def scalar(value: ir.Value | None) -> float | None:
    """The value of a one-element constant (initializer or Constant node), else None."""
    if value is None:
        return None
    tensor = value.const_value
    producer = value.producer()
    if tensor is None and producer is not None and producer.op_type == "Constant":
        attribute = producer.attributes.get("value")
        tensor = attribute.as_tensor() if attribute is not None else None
    if tensor is None or math.prod(tensor.shape.numpy()) != 1:
        return None
    return float(np.asarray(tensor.numpy()).reshape(-1)[0])


def _check_mask(mask: ir.Value, graph: ir.Graph) -> None:
    """Rule 3: the mask reads the values of attention_mask only (shapes of anything)."""
    inputs = {id(value): value for value in graph.inputs}
    pending, seen = [mask], set()
    while pending:
        value = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if id(value) in inputs and value.name != MASK_INPUT:
            raise _Refusal(f"the attention mask {mask.name!r} reads the values of input "
                           f"{value.name!r}; only {MASK_INPUT!r} may shape it")
        node = value.producer()
        if node is not None and node.op_type not in _SHAPE_OPS:
            pending.extend(item for item in node.inputs if item is not None)


def _kv_dims(past: ir.Value) -> tuple[int, int]:
    shape = past.shape
    assert shape is not None and len(shape) == KV_RANK, "_past_is_kv_input checked it"
    kv_heads, head_size = shape[1], shape[3]
    if not isinstance(kv_heads, int) or not isinstance(head_size, int):
        raise _Refusal(f"the past input {past.name!r} has shape "
                       f"{value_tracing.shape_text(past.shape)}; its KV heads and head size "
                       "(axes 1 and 3) must be fixed")
    return kv_heads, head_size


def _query_heads(query: ir.Value, head_size: int) -> int:
    """Query heads from the query's shape, else from the nearest projection's weight width."""
    if query.shape is not None and len(query.shape) == KV_RANK \
            and isinstance(query.shape[1], int):
        return query.shape[1]
    pending, seen = [query], set[int]()
    while pending and len(seen) < _PROJECTION_SEARCH:
        value = pending.pop(0)
        if id(value) in seen:
            continue
        seen.add(id(value))
        node = value.producer()
        if node is None:
            continue
        if node.op_type in ("MatMul", "Gemm"):
            weight = node.inputs[1]
            tensor = weight.const_value if weight is not None else None
            width = tensor.shape.numpy()[1] if tensor is not None and len(tensor.shape) == 2 \
                else None
            if width is not None and width % head_size == 0:
                return width // head_size
        pending.extend(item for item in node.inputs if item is not None)
    raise _Refusal(f"cannot tell the number of query heads of {query.name!r}: neither its "
                   "shape nor a projection's weight near it says")

