"""select_row: the logits output becomes the one row an input picks (numerics: the device-path
test in tests/cuda/test_graph_lifecycle.py)."""

import tracemalloc

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.graph.logits_row import ALL_ROWS, ROW_INPUT, select_row


def _selected(path):
    return ir.serde.deserialize_model(onnx.load_from_string(select_row(path.read_bytes())))


def test_logits_become_a_gather_of_the_full_rows(reference_model):
    model = _selected(reference_model())
    outputs = {value.name: value for value in model.graph.outputs}
    assert list(outputs)[0] == "logits" and ALL_ROWS in outputs
    picked = outputs["logits"]
    node = picked.producer()
    assert node.op_type == "Gather" and node.attributes["axis"].value == 1
    assert [value.name for value in node.inputs] == [ALL_ROWS, ROW_INPUT]
    assert picked.shape[1] == 1 and picked.shape[2] == outputs[ALL_ROWS].shape[2]
    row = model.graph.inputs[-1]
    assert row.name == ROW_INPUT and list(row.shape) == [1]


def test_a_model_returning_one_row_is_refused(reference_model):
    with pytest.raises(ModelStructureError, match="one row already"):
        _selected(reference_model("last_token_logits"))


def test_every_other_field_keeps_its_bytes(reference_model):
    original = onnx.load(str(reference_model()), load_external_data=False)
    selected = onnx.load_from_string(select_row(reference_model().read_bytes()))
    assert selected.metadata_props == original.metadata_props
    assert selected.graph.initializer == original.graph.initializer
    assert list(selected.graph.input)[:-1] == list(original.graph.input)
    assert list(selected.graph.node)[-1].op_type == "Gather"
    renamed = [node for node in original.graph.node if "logits" in node.output]
    assert [list(node.output) for node in selected.graph.node if ALL_ROWS in node.output] == [
        [ALL_ROWS if name == "logits" else name for name in node.output] for node in renamed]


def test_a_model_without_logits_is_refused(reference_model):
    proto = onnx.load(str(reference_model()), load_external_data=False)
    for value in proto.graph.output:
        if value.name == "logits":
            value.name = "scores"
    with pytest.raises(ModelStructureError, match="no 'logits' output"):
        select_row(proto.SerializeToString())


def test_inline_weights_are_copied_once(tmp_path):
    # A decoder stored inline (as exporters write models under 2 GB): the rewrite keeps the
    # unchanged fields as views until one join, so it allocates about the model once.
    weights = onnx.numpy_helper.from_array(np.zeros((1024, 4096), dtype=np.float32), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["logits"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", "s", 1024])],
        [onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["b", "s", 4096])],
        [weights])
    data = onnx.helper.make_model(graph).SerializeToString()
    tracemalloc.start()
    try:
        selected = select_row(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert onnx.load_from_string(selected).graph.initializer[0] == weights
    assert peak < 1.2 * len(data), (peak, len(data))
