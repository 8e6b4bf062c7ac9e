"""Find recurrent state (conv, SSM, recurrent) that a decoder carries from step to step."""

from __future__ import annotations

import logging
import re

import onnx_ir as ir

from onnx_chunk.graph import chunk_plan, metadata
from onnx_chunk.passes import value_tracing
from onnx_chunk.passes.kv_capacity import kv_past_inputs, kv_present_outputs
from onnx_chunk.passes.token_input import ATTENTION_MASK, axis_keys, has_query_axis, token_input

logger = logging.getLogger(__name__)

# Names exporters give to state inputs: LFM2-style `past.%d.conv`, `past_key_values.%d.conv_state`
# and the `...ssm_state` / `...recurrent_state` of SSM and linear-attention layers.
_STATE_NAME = re.compile(r"^past\.\d+\.conv$|(^|[._])(conv_state|ssm_state|recurrent_state)$")
_PAST_PREFIX = re.compile(r"^(past_key_values|past)\.")


class RecurrentStatePass(ir.passes.InPlacePass):
    """Record the state inputs that make query-axis padding unsafe.

    Padded rows are harmless to GQA KV because the runtime rewinds the logical length and the
    next chunk overwrites them. Recurrent or convolutional state is neither masked nor addressed
    by a logical length: every row advances it and nothing can take a padded row back.

    Rules:
    1. Inputs that some GroupQueryAttention reads as past (inputs 3 and 4) are never state;
       nor are the token input, `attention_mask`, or an input whose axis 1 has the token
       input's symbolic query-axis name (a per-token port: it grows with the query, so an
       output of the same shape, such as a [batch, rows] int64 output, is no carried state).
    2. An input whose name matches a state template (`past.%d.conv`,
       `past_key_values.%d.conv_state`, `...ssm_state`, `...recurrent_state`) is state; it is
       paired with the output named `present.<rest>` when there is one.
    3. In a graph with a token input, an input paired with a graph output of the same dtype
       and the same shape (symbolic names included) is state, unless that output is a GQA
       (or TensorScatter) present. Several candidates are told apart by name (`present.<rest>`
       first, then the longest common suffix). A graph without a token input is no decoder
       step, so nothing in it is carried from step to step: equal shapes alone (`c = a + b`)
       prove nothing.
    4. Each output pairs with one input at most.
    5. The findings go to the inference metadata; the pass reports a modification only when
       they differ from what is stored.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        findings = find_recurrent_state(model)
        modified = metadata.write_recurrent_state(model, findings)
        if modified and findings.bindings:
            logger.info("recurrent state: %s",
                        ", ".join(binding.input for binding in findings.bindings))
        return ir.passes.PassResult(model, modified=modified)


def find_recurrent_state(model: ir.Model) -> chunk_plan.RecurrentStateFindings:
    """What the pass records, computed without touching the model."""
    graph = model.graph
    skipped = kv_past_inputs(graph) | {ATTENTION_MASK}
    token = token_input(graph)
    rows_key = None
    if token is not None:
        skipped.add(value_tracing.name_of(token))
        rows_key = axis_keys(token)[1]
    kv_presents = kv_present_outputs(graph)
    free_outputs = [output for output in graph.outputs if output.name not in kv_presents]
    bindings: list[chunk_plan.StateBinding] = []
    for value in graph.inputs:
        name = value_tracing.name_of(value)
        if name in skipped or has_query_axis(value, rows_key):
            continue
        by_name = _STATE_NAME.search(name) is not None
        matching = ([output for output in free_outputs if _same_type(value, output)]
                    if token is not None else [])
        output = _best_partner(name, matching)
        if output is None and by_name:
            named = _PAST_PREFIX.sub("present.", name)
            output = next((out for out in free_outputs if out.name == named), None)
        if not by_name and output is None:
            continue
        structural = output is not None and output in matching
        detected_by = ("name+structure" if by_name and structural
                       else "name" if by_name else "structure")
        if output is not None:
            free_outputs.remove(output)
        bindings.append(chunk_plan.StateBinding(
            input=name,
            output=value_tracing.name_of(output) if output is not None else "",
            detected_by=detected_by,
        ))
    return chunk_plan.RecurrentStateFindings(bindings=tuple(bindings))


def _same_type(first: ir.Value, second: ir.Value) -> bool:
    shape = first.shape
    return (first.dtype is not None and first.dtype == second.dtype
            and shape is not None and value_tracing.same_dims(shape, second.shape)
            and all(value_tracing.dim_key(dim) is not None for dim in shape))


def _best_partner(name: str, candidates: list[ir.Value]) -> ir.Value | None:
    if not candidates:
        return None
    named = _PAST_PREFIX.sub("present.", name)
    for candidate in candidates:
        if candidate.name == named:
            return candidate
    return max(candidates,
               key=lambda candidate: _common_suffix(name, value_tracing.name_of(candidate)))


def _common_suffix(first: str, second: str) -> int:
    length = 0
    for a, b in zip(reversed(first), reversed(second)):
        if a != b:
            break
        length += 1
    return length
