"""Find the inputs that carry one row per query token, which padding widens with the query."""

from __future__ import annotations

import logging

import onnx_ir as ir

from onnx_chunk.graph import chunk_plan, metadata
from onnx_chunk.passes import value_tracing
from onnx_chunk.passes.kv_capacity import kv_past_inputs
from onnx_chunk.passes.token_input import (
    ATTENTION_MASK,
    INTEGER_TYPES,
    axis_keys,
    has_query_axis,
    token_input,
)

logger = logging.getLogger(__name__)

POSITION_IDS = "position_ids"
_GQA_POSITION_IDS_INPUT = 9
_ROTARY_POSITION_IDS_INPUT = 1


class PerTokenPortsPass(ir.passes.InPlacePass):
    """Record the per-token ports and every input that rules a padding plan out.

    Padding runs a chunk at a ladder width: padded rows repeat the last real token, and every
    port fed per token must be widened the same way. A port that is fed per request but has no
    row axis cannot be widened, so it voids the plan instead of having rows invented for it.

    Rules:
    1. The token input is `input_ids`, else `inputs_embeds`, else the integer [batch, rows]
       input a Gather reads as indices (an embedding lookup). Its axis 1 is the query axis.
    2. A graph input shaped [batch, rows, ...] whose axis 0 and axis 1 have the token input's
       symbolic names is per-token; the token input itself is one.
    3. KV past inputs (GQA or TensorScatter), `attention_mask`, recurrent state and the
       `query_seqlens` and `logits_rows` inputs their passes wired are not request-fed rows and are
       left alone. Every other input voids the padding plan, named in
       the reason. Recurrent state is what the recurrent state pass stored in the metadata; the
       pass refuses to run before it.
    4. A query axis that is fixed or unnamed cannot be matched, and voids the plan.
    5. position_ids is the integer per-token port named so, or the one that feeds GQA
       position_ids (input 9) or a RotaryEmbedding's position_ids (input 1); padded rows
       continue its positions instead of repeating them.
    6. The findings go to the inference metadata; the pass reports a modification only when
       they differ from what is stored.
    """

    def requires(self, model: ir.Model) -> None:
        if metadata.read_recurrent_state(model) is None:
            raise ir.passes.PreconditionError(
                "the per-token ports pass needs the recurrent state pass's findings; run "
                "RecurrentStatePass first, or the whole pipeline (onnx_chunk.passes.convert_model)"
            )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        state = metadata.read_recurrent_state(model)
        assert state is not None, "requires() checked it"
        findings = find_per_token_ports(model, state)
        modified = metadata.write_per_token_ports(model, findings)
        if modified:
            logger.info("per-token ports: %s; %d inputs void padding",
                        ", ".join(findings.ports) or "none", len(findings.voids))
        return ir.passes.PassResult(model, modified=modified)


def find_per_token_ports(model: ir.Model,
                         state: chunk_plan.RecurrentStateFindings) -> chunk_plan.PerTokenFindings:
    """What the pass records given the model's recurrent `state`, without touching the model."""
    graph = model.graph
    token = token_input(graph)
    if token is None:
        names = ", ".join(value_tracing.name_of(value) for value in graph.inputs) or "none"
        return chunk_plan.PerTokenFindings(
            token_input="",
            ports=(),
            position_ids=None,
            voids=(metadata.port_void(
                "input_ids", f"(or inputs_embeds) is missing: the graph inputs are {names}, so "
                "the query axis is unknown and no port can be widened"),),
        )
    skipped = kv_past_inputs(graph) | {ATTENTION_MASK}
    skipped |= {binding.input for binding in state.bindings}
    wired = metadata.read_query_seqlens(model)
    if wired is not None:
        skipped.add(wired)
    rows = metadata.read_logits_rows(model)
    if rows is not None:
        skipped.add(rows)
    token_name = value_tracing.name_of(token)
    batch_key, rows_key = axis_keys(token)
    if not isinstance(rows_key, str):
        return chunk_plan.PerTokenFindings(
            token_input=token_name,
            ports=(token_name,),
            position_ids=None,
            voids=(metadata.port_void(
                token_name, f"has shape {value_tracing.shape_text(token.shape)}: its query "
                "axis (1) is fixed or unnamed, so per-token ports cannot be matched to it"),),
        )
    ports = [token_name]
    voids: list[str] = []
    for value in graph.inputs:
        name = value_tracing.name_of(value)
        if value is token or name in skipped:
            continue
        if _is_per_token(value, batch_key, rows_key):
            ports.append(name)
        else:
            voids.append(metadata.port_void(
                name,
                f"shaped {value_tracing.shape_text(value.shape)} is fed per request but is not "
                f"[{batch_key}, {rows_key}, ...] like {token.name!r}, so padding cannot widen it",
            ))
    position_ids = _position_ids(graph, ports)
    return chunk_plan.PerTokenFindings(
        token_input=token_name,
        ports=tuple(ports),
        position_ids=position_ids,
        voids=tuple(voids),
    )


def _is_per_token(value: ir.Value, batch_key: object, rows_key: str) -> bool:
    shape = value.shape
    return (has_query_axis(value, rows_key) and shape is not None
            and value_tracing.dim_key(shape[0]) == batch_key)


def _position_ids(graph: ir.Graph, ports: list[str]) -> str | None:
    candidates = [value for value in graph.inputs
                  if value.name in ports[1:] and value.dtype in INTEGER_TYPES
                  and value.shape is not None and len(value.shape) == 2]
    for value in candidates:
        if value.name == POSITION_IDS:
            return value.name
    feeding = {id(value_tracing.source(position))
               for position in _position_inputs(graph) if position is not None}
    for value in candidates:
        if id(value) in feeding:
            return value.name
    return None


def _position_inputs(graph: ir.Graph) -> list[ir.Value | None]:
    found: list[ir.Value | None] = []
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if value_tracing.is_gqa(node):
            found.append(value_tracing.input_at(node, _GQA_POSITION_IDS_INPUT))
        elif node.op_type == "RotaryEmbedding" and node.domain == value_tracing.MICROSOFT_DOMAIN:
            found.append(value_tracing.input_at(node, _ROTARY_POSITION_IDS_INPUT))
    return found
