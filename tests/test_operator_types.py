"""`operator_types.type_errors`: ONNX Runtime's type rules on a graph's declared types.

Each graph here is also given to ONNX Runtime: what `type_errors` reports, ONNX Runtime refuses
to load, and what it accepts, ONNX Runtime loads (the check is a subset of its rules, never a
rule of its own). onnx's schemas (`load_model`'s, no ONNX Runtime needed) cover the standard
operators; ONNX Runtime's (`validate`'s) its contrib operators too.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_chunk.graph.operator_types import onnx_schema, type_errors
from onnx_chunk.ort_schemas import runtime_signature
from tests.exports.corpus import fixtures

FLOAT, INT64, UINT8 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.UINT8


def _model(nodes, inputs, outputs, value_info=(), initializers=(), opset=21,
           domains=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers),
                              value_info=list(value_info))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                   *(helper.make_opsetid(domain, 1)
                                                     for domain in domains)])


def _errors(proto: onnx.ModelProto, schema_of=onnx_schema) -> list[str]:
    return type_errors(ir.serde.deserialize_model(proto), schema_of)


def _ort_loads(proto: onnx.ModelProto) -> bool:
    try:
        onnxruntime.InferenceSession(proto.SerializeToString(),
                                     providers=["CPUExecutionProvider"])
    except Exception:  # ONNX Runtime's load failures come in several types
        return False
    return True


def _vector(name, elem_type):
    return helper.make_tensor_value_info(name, elem_type, [4])


def test_a_graph_within_the_rules_has_no_error_and_loads():
    proto = _model([helper.make_node("Add", ["a", "b"], ["s"]),
                    helper.make_node("Relu", ["s"], ["y"])],
                   [_vector("a", FLOAT), _vector("b", FLOAT)], [_vector("y", FLOAT)],
                   value_info=[_vector("s", FLOAT)])
    assert _errors(proto) == [] and _ort_loads(proto)


@pytest.mark.parametrize("schema_of", [onnx_schema, runtime_signature])
def test_an_initializers_and_a_constants_type_is_their_tensors(schema_of):
    """ONNX Runtime builds an initializer and a Constant's output from the tensor, so a
    value_info declaring another type for them is never applied: no error, in a branch of an
    If either."""
    constant = helper.make_node("Constant", [], ["c"], value=helper.make_tensor(
        "v", FLOAT, [4], [1.0] * 4))
    weight = numpy_helper.from_array(np.ones(4, np.float32), "w")
    stale = [_vector("c", INT64), _vector("w", INT64)]
    proto = _model([constant, helper.make_node("Add", ["x", "c"], ["s"]),
                    helper.make_node("Mul", ["s", "w"], ["y"])],
                   [_vector("x", FLOAT)], [_vector("y", FLOAT)], value_info=stale,
                   initializers=[weight])
    assert _errors(proto, schema_of) == [] and _ort_loads(proto)
    branch = helper.make_graph([helper.make_node("Constant", [], ["k"], value_float=2.0),
                                helper.make_node("Mul", ["x", "k"], ["b"])], "branch", [],
                               [_vector("b", FLOAT)], value_info=[_vector("k", INT64)])
    flag = numpy_helper.from_array(np.array(True), "flag")
    proto = _model([helper.make_node("If", ["flag"], ["y"], then_branch=branch,
                                     else_branch=branch)],
                   [_vector("x", FLOAT)], [_vector("y", FLOAT)], initializers=[flag])
    assert _errors(proto, schema_of) == [] and _ort_loads(proto)


@pytest.mark.parametrize("schema_of", [onnx_schema, runtime_signature])
def test_a_declared_output_type_other_than_the_inputs_is_an_error(schema_of):
    proto = _model([helper.make_node("Relu", ["a"], ["s"], name="relu"),
                    helper.make_node("Cast", ["s"], ["y"], to=FLOAT)],
                   [_vector("a", FLOAT)], [_vector("y", FLOAT)],
                   value_info=[_vector("s", UINT8)])
    assert _errors(proto, schema_of) == ["node 'relu' (Relu) declares its output 's' as "
                                         "tensor(uint8), where it is tensor(float) (the type of "
                                         "'a')"]
    assert not _ort_loads(proto)


def test_onnx_runtimes_schemas_check_its_contrib_operators():
    """A com.microsoft::FastGelu output declared int64: onnx has no schema for it, ONNX
    Runtime's binds it to its input's float."""
    proto = _model([helper.make_node("FastGelu", ["a"], ["s"], name="gelu",
                                     domain="com.microsoft"),
                    helper.make_node("Cast", ["s"], ["y"], to=FLOAT)],
                   [_vector("a", FLOAT)], [_vector("y", FLOAT)],
                   value_info=[_vector("s", INT64)], domains=["com.microsoft"])
    assert _errors(proto) == []
    assert _errors(proto, runtime_signature) == [
        "node 'gelu' (FastGelu) declares its output 's' as tensor(int64), where it is "
        "tensor(float) (the type of 'a')"]
    assert not _ort_loads(proto)
    proto.graph.value_info[0].type.tensor_type.elem_type = FLOAT
    assert _errors(proto, runtime_signature) == [] and _ort_loads(proto)


def test_inputs_of_one_type_parameter_must_share_their_type():
    proto = _model([helper.make_node("Add", ["a", "b"], ["y"], name="add")],
                   [_vector("a", FLOAT), _vector("b", INT64)], [_vector("y", FLOAT)])
    assert _errors(proto) == ["node 'add' (Add) reads 'a' of type tensor(float) and 'b' of "
                              "type tensor(int64), which its schema requires to be one type (T)"]
    assert not _ort_loads(proto)


def test_an_input_type_the_parameter_does_not_take_is_an_error():
    shape = numpy_helper.from_array(np.array([4], dtype=np.int32), "shape")
    proto = _model([helper.make_node("Reshape", ["a", "shape"], ["y"], name="reshape")],
                   [_vector("a", FLOAT)], [_vector("y", FLOAT)], initializers=[shape])
    assert _errors(proto) == ["node 'reshape' (Reshape) reads 'shape' of type tensor(int32), "
                              "which its input 'shape' does not take"]
    assert not _ort_loads(proto)


def test_a_variadic_homogeneous_input_binds_every_value():
    proto = _model([helper.make_node("Concat", ["a", "b", "c"], ["y"], axis=0, name="cat")],
                   [_vector("a", FLOAT), _vector("b", FLOAT), _vector("c", INT64)],
                   [helper.make_tensor_value_info("y", FLOAT, [12])])
    assert _errors(proto) == ["node 'cat' (Concat) reads 'a' of type tensor(float) and 'c' of "
                              "type tensor(int64), which its schema requires to be one type "
                              "(T)"]
    assert not _ort_loads(proto)


def test_an_operator_without_a_schema_is_left_to_its_own_error():
    proto = _model([helper.make_node("NoSuchOp", ["a"], ["y"], domain="example.custom")],
                   [_vector("a", FLOAT)], [_vector("y", UINT8)], domains=["example.custom"])
    assert _errors(proto) == [] and _errors(proto, runtime_signature) == []


@pytest.mark.parametrize("fixture", fixtures(), ids=lambda fixture: fixture.name)
def test_every_corpus_export_keeps_the_rules(fixture):
    proto = onnx.load(str(fixture.folder / "model.onnx"), load_external_data=False)
    assert _errors(proto) == [] and _errors(proto, runtime_signature) == []
