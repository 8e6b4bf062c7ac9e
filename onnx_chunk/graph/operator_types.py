"""The element types a graph declares, checked against its operators' schemas.

ONNX Runtime refuses to load a graph whose declared types break an operator's type rules
(`Graph::InferAndVerifyTypeMatch`, onnxruntime/core/graph/graph.cc): an input's type must be one
its formal parameter permits, the inputs of a homogeneous type parameter ("T") must share one
type, and an output declared with a type must have the one that parameter binds (the inputs'
type, or the parameter's only permitted type): "Type Error: Type (tensor(uint8)) of output arg
(...) does not match expected type (tensor(float))". onnx's checker does not check this without
its full (strict) shape inference, which builder exports fail on their Constant nodes' declared
shapes alone.

`type_errors` applies those three rules to the types the file declares (initializers, graph
inputs, value_info). It checks less than ONNX Runtime (no inference of undeclared types), never
more: what it reports, ONNX Runtime refuses too. The schemas come from `onnx_schema` (onnx's
own, the ones ONNX Runtime applies to the standard domains; what `load_model` uses, so that a
conversion needs no ONNX Runtime) or `ort_schemas.runtime_signature` (the installed ONNX
Runtime's, its contrib operators included; what `validate` uses).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import onnx.defs
import onnx_ir as ir

_DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class Parameter:
    """One formal input or output of an operator's schema."""

    name: str
    type_str: str  # a type parameter ("T") or one type ("tensor(int64)")
    variadic: bool
    homogeneous: bool


@dataclass(frozen=True)
class Signature:
    """The type rules of one version of an operator."""

    inputs: tuple[Parameter, ...]
    outputs: tuple[Parameter, ...]
    constraints: dict[str, frozenset[str]]  # type parameter -> the types it permits


SchemaSource = Callable[[str, str, int], "Signature | None"]


def signature_of(schema: Any, parameter: Callable[[Any], Parameter]) -> Signature:
    """The Signature of an onnx or ONNX Runtime schema (their type constraints read alike),
    its formal parameters read by `parameter` (their attribute names differ)."""
    return Signature(tuple(map(parameter, schema.inputs)), tuple(map(parameter, schema.outputs)),
                     {constraint.type_param_str: frozenset(constraint.allowed_type_strs)
                      for constraint in schema.type_constraints})


def onnx_schema(domain: str, op_type: str, opset_version: int) -> Signature | None:
    """onnx's schema of `domain::op_type` at `opset_version`, None when onnx has none (or it
    is deprecated there)."""
    try:
        schema = onnx.defs.get_schema(op_type, opset_version, domain)
    except onnx.defs.SchemaError:
        return None
    if schema.deprecated:
        return None

    return signature_of(schema, lambda formal: Parameter(
        formal.name, formal.type_str,
        formal.option == onnx.defs.OpSchema.FormalParameterOption.Variadic,
        formal.is_homogeneous))


# The type of a Constant node's output by the attribute that holds its value (a `value`
# tensor's own type is read from it).
_CONSTANT_TYPES = {"value_float": ir.DataType.FLOAT, "value_floats": ir.DataType.FLOAT,
                   "value_int": ir.DataType.INT64, "value_ints": ir.DataType.INT64,
                   "value_string": ir.DataType.STRING, "value_strings": ir.DataType.STRING}


def type_string(value: ir.Value) -> str | None:
    """ONNX's name of a tensor value's type ("tensor(float)") as ONNX Runtime takes it, None
    when unknown: an initializer's and a Constant's from the tensor itself, another value's as
    declared. ONNX Runtime 1.32 loads a graph whose value_info gives an initializer or a
    Constant's output another type than its tensor's (tests/test_operator_types.py, which
    loads it): the declaration is not what it checks those values by."""
    dtype = _constant_dtype(value)
    if dtype is None:
        if not isinstance(value.type, ir.TensorType):
            return None
        dtype = value.dtype
    return None if dtype is None else f"tensor({dtype.name.lower()})"


def _constant_dtype(value: ir.Value) -> ir.DataType | None:
    if value.const_value is not None:
        return value.const_value.dtype
    producer = value.producer()
    if producer is None or producer.op_type != "Constant" or producer.domain not in (
            _DEFAULT_DOMAINS):
        return None
    for name, attribute in producer.attributes.items():
        if name == "value" and isinstance(attribute.value, ir.TensorProtocol):
            return attribute.value.dtype
        if name in _CONSTANT_TYPES:
            return _CONSTANT_TYPES[name]
    return None


def type_errors(model: ir.Model, schema_of: SchemaSource = onnx_schema) -> list[str]:
    """One line per node of `model` (its subgraphs included) whose declared types break the
    type rules of its schema in `schema_of`; nodes of operators it lacks are left out."""
    errors = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        domain = "" if node.domain in _DEFAULT_DOMAINS else node.domain
        version = node.version if node.version is not None else model.opset_imports.get(
            domain, model.opset_imports.get("ai.onnx") if domain == "" else None)
        if version is None:
            continue
        signature = schema_of(domain, node.op_type, version)
        if signature is not None and (error := _node_error(node, signature)) is not None:
            errors.append(error)
    return errors


def _node_error(node: ir.Node, signature: Signature) -> str | None:
    constraints = signature.constraints
    known = frozenset().union(*constraints.values())
    bound: dict[str, tuple[str, str]] = {}  # type parameter -> (type, the input that bound it)
    name = node.name or node.op_type
    for parameter, value in _actuals(signature.inputs, node.inputs):
        if value is None or (actual := type_string(value)) is None:
            continue
        permitted = constraints.get(parameter.type_str, frozenset({parameter.type_str}))
        # a type string no schema names (a newer dtype) is not taken for a violation
        if actual not in permitted and actual in known | permitted:
            return (f"node {name!r} ({node.op_type}) reads {value.name!r} of type {actual}, "
                    f"which its input {parameter.name!r} does not take")
        if not parameter.homogeneous:
            continue
        first = bound.setdefault(parameter.type_str, (actual, str(value.name)))
        if first[0] != actual:
            return (f"node {name!r} ({node.op_type}) reads {first[1]!r} of type {first[0]} and "
                    f"{value.name!r} of type {actual}, which its schema requires to be one type "
                    f"({parameter.type_str})")
    for parameter, value in _actuals(signature.outputs, node.outputs):
        if value is None or (declared := type_string(value)) is None:
            continue
        permitted = constraints.get(parameter.type_str, frozenset({parameter.type_str}))
        if parameter.homogeneous and parameter.type_str in bound:
            expected, reader = bound[parameter.type_str]
            source = f"the type of {reader!r}"
        elif len(permitted) == 1:
            expected, source = next(iter(permitted)), "the only type its schema gives it"
        else:
            continue
        if declared != expected:
            return (f"node {name!r} ({node.op_type}) declares its output {value.name!r} as "
                    f"{declared}, where it is {expected} ({source})")
    return None


def _actuals(formals: tuple[Parameter, ...], actuals) -> Iterator[tuple[Parameter,
                                                                       ir.Value | None]]:
    """(formal parameter, actual value) pairs: a variadic last parameter takes the rest."""
    for index, value in enumerate(actuals):
        if not formals or (index >= len(formals) and not formals[-1].variadic):
            return
        yield formals[min(index, len(formals) - 1)], value
