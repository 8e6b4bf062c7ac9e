"""structure.checker accepts the default-domain operators ONNX Runtime registers, and no others."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from onnx_chunk.validate.checks import STRUCTURE
from onnx_chunk.validate.report import Outcome
from onnx_chunk.validate.structure import check_checker
from onnx_chunk.validate.subject import load_subject
from onnx_chunk.validate.timing import Stopwatch


def _one_node_model(path, op_type: str, **attributes) -> None:
    node = helper.make_node(op_type, ["x", "scale"], ["y"], **attributes)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)]), str(path))


def _checker(path):
    return check_checker(load_subject(path), Stopwatch(STRUCTURE))


def test_simplified_layer_normalization_in_the_default_domain_passes(tmp_path):
    _one_node_model(tmp_path / "m.onnx", "SimplifiedLayerNormalization", epsilon=1e-5, axis=-1)
    result = _checker(tmp_path / "m.onnx")
    assert result.outcome is Outcome.PASSED, result.reason
    assert "SimplifiedLayerNormalization" in result.reason


@pytest.mark.parametrize("op_type, attributes", [
    ("NoSuchOperator", {}),
    ("SimplifiedLayerNormalization", {"not_an_attribute": 1}),
])
def test_an_unknown_operator_or_attribute_still_fails(tmp_path, op_type, attributes):
    _one_node_model(tmp_path / "m.onnx", op_type, **attributes)
    result = _checker(tmp_path / "m.onnx")
    assert result.outcome is Outcome.FAILED
    assert op_type in result.reason or "not_an_attribute" in result.reason
