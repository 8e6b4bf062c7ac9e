"""select_row: the logits output becomes the one row an input picks (numerics: the device-path
test in tests/cuda/test_graph_lifecycle.py)."""

import pytest

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.model_io import load_model
from onnx_chunk.runtime.logits_row import ALL_ROWS, ROW_INPUT, select_row


def test_logits_become_a_gather_of_the_full_rows(reference_model):
    model = select_row(load_model(reference_model()))
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
        select_row(load_model(reference_model("last_token_logits")))
