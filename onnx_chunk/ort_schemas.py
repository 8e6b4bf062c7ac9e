"""The default-domain operators ONNX Runtime registers and onnx does not, taught to onnx's checker.

onnxruntime-genai's builder writes `SimplifiedLayerNormalization` in the default ONNX domain:
ONNX Runtime registers it there, onnx does not (onnx/onnx#6582), so `onnx.checker` rejects every
builder export. Rather than keep a list by hand, ONNX Runtime is asked for its schemas and each
default-domain one that onnx lacks entirely is registered with onnx, inputs, outputs, type
constraints and attributes as ONNX Runtime declares them; the checker then checks those nodes
like any other, and an operator neither knows still fails.
"""

from __future__ import annotations

import functools
import logging

import onnx.defs
from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

from onnx_chunk.graph.operator_types import Parameter, Signature, signature_of

logger = logging.getLogger(__name__)

_DEFAULT_DOMAINS = ("", "ai.onnx")
_OpSchema = onnx.defs.OpSchema


@functools.lru_cache(maxsize=1)
def register_runtime_schemas() -> frozenset[str]:
    """Register every default-domain schema ONNX Runtime has and onnx lacks; return their names."""
    registered: set[str] = set()
    for schema in ort_c.get_all_operator_schema():
        if schema.domain not in _DEFAULT_DOMAINS or onnx.defs.has(schema.name, schema.domain):
            continue
        if schema.name in registered:
            continue
        try:
            onnx.defs.register_schema(_as_onnx_schema(schema))
        except Exception as error:  # onnx refuses a schema it cannot represent: leave it out
            logger.info("cannot teach onnx's checker %s: %s", schema.name, error)
            continue
        registered.add(schema.name)
    logger.info("registered %d ONNX Runtime default-domain schemas with onnx", len(registered))
    return frozenset(registered)


def _as_onnx_schema(schema) -> _OpSchema:
    return _OpSchema(
        schema.name, schema.domain, schema.since_version, schema.doc or "",
        inputs=[_parameter(parameter) for parameter in schema.inputs],
        outputs=[_parameter(parameter) for parameter in schema.outputs],
        type_constraints=[(constraint.type_param_str, list(constraint.allowed_type_strs), "")
                          for constraint in schema.type_constraints],
        attributes=[_OpSchema.Attribute(name, getattr(_OpSchema.AttrType, attribute.type.name),
                                        attribute.description or "",
                                        required=attribute.required)
                    for name, attribute in schema.attributes.items()],
    )


def _parameter(parameter) -> _OpSchema.FormalParameter:
    return _OpSchema.FormalParameter(
        parameter.name, parameter.typeStr, "",
        param_option=getattr(_OpSchema.FormalParameterOption, parameter.option.name),
        is_homogeneous=parameter.isHomogeneous)


def gqa_cache_types() -> frozenset[str]:
    """The KV cache element types ONNX Runtime's GroupQueryAttention schema accepts with scales.

    Read from the installed ONNX Runtime's schema (onnxruntime/core/graph/contrib_ops/
    bert_defs.cc): the `T_CACHE` constraint of past_key (e.g. "tensor(int8)", "tensor(uint8)"
    for packed int4), counted only when the schema also has the `k_scale` input and the
    `kv_cache_bit_width` attribute that a quantized cache needs. Empty without them.
    """
    for schema in ort_c.get_all_operator_schema():
        if schema.name != "GroupQueryAttention" or schema.domain != "com.microsoft":
            continue
        if ("kv_cache_bit_width" not in schema.attributes
                or not any(parameter.name == "k_scale" for parameter in schema.inputs)):
            return frozenset()
        past = next((parameter for parameter in schema.inputs if parameter.name == "past_key"),
                    None)
        if past is None:
            return frozenset()
        for constraint in schema.type_constraints:
            if constraint.type_param_str == past.typeStr:
                return frozenset(constraint.allowed_type_strs)
    return frozenset()


def input_types(domain: str, op_type: str, input_name: str) -> frozenset[str]:
    """The element types the installed ONNX Runtime's schema of `domain::op_type` allows for its
    input `input_name` (e.g. "tensor(uint8)"); empty when it has no such operator or input.
    Read from `get_all_operator_schema()`, never from a version number."""
    for schema in ort_c.get_all_operator_schema():
        if schema.name != op_type or schema.domain != domain:
            continue
        parameter = next((parameter for parameter in schema.inputs
                          if parameter.name == input_name), None)
        if parameter is None:
            return frozenset()
        return next((frozenset(constraint.allowed_type_strs)
                     for constraint in schema.type_constraints
                     if constraint.type_param_str == parameter.typeStr), frozenset())
    return frozenset()


@functools.lru_cache(maxsize=1)
def _schemas_by_operator() -> dict[tuple[str, str], list]:
    """(domain, name) -> the installed ONNX Runtime's schemas of that operator, oldest first."""
    index: dict[tuple[str, str], list] = {}
    for schema in ort_c.get_all_operator_schema():
        domain = "" if schema.domain in _DEFAULT_DOMAINS else schema.domain
        index.setdefault((domain, schema.name), []).append(schema)
    for schemas in index.values():
        schemas.sort(key=lambda schema: schema.since_version)
    return index


def runtime_signature(domain: str, op_type: str, opset_version: int) -> Signature | None:
    """The type rules of the installed ONNX Runtime's schema of `domain::op_type` at
    `opset_version` (the newest one since that version or before, as ONNX Runtime resolves a
    node), its contrib operators included; None when it has none or it is deprecated there."""
    domain = "" if domain in _DEFAULT_DOMAINS else domain
    found = None
    for schema in _schemas_by_operator().get((domain, op_type), ()):
        if schema.since_version > opset_version:
            break
        found = schema
    if found is None or found.deprecated:
        return None

    return signature_of(found, lambda formal: Parameter(
        formal.name, formal.typeStr, formal.option.name == "Variadic", formal.isHomogeneous))
