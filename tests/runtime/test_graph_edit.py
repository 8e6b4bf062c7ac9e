"""graph_edit.edit_decoder: a decoder's graph replaced in its serialized bytes."""

import onnx
import pytest

from onnx_chunk.errors import ModelLoadError, ModelStructureError
from onnx_chunk.graph.graph_edit import edit_decoder
from onnx_chunk.graph.onnx_wire import encode_len_field


def test_the_graph_is_replaced_the_fields_named_dropped_and_the_rest_kept():
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"], name="relu")],
                                   "g", [onnx.helper.make_tensor_value_info("x", 1, [2])],
                                   [onnx.helper.make_tensor_value_info("y", 1, [2])])
    model = onnx.helper.make_model(graph, producer_name="tests")
    onnx.helper.set_model_props(model, {"keep": "1", "drop": "2"})
    data = model.SerializeToString()
    renamed = graph.__class__()
    renamed.CopyFrom(graph)
    renamed.name = "edited"

    def dropped(number, value):
        return number == 14 and b"drop" in data[slice(*value)]

    edited = onnx.load_from_string(edit_decoder(
        data, lambda view, span: [renamed.SerializeToString()], dropped))
    assert edited.graph == renamed and edited.producer_name == "tests"
    assert [entry.key for entry in edited.metadata_props] == ["keep"]
    for graphs in (0, 2):
        without = onnx.ModelProto()
        without.CopyFrom(model)
        without.ClearField("graph")
        extra = b"".join(encode_len_field(7, graph.SerializeToString())
                         for _ in range(graphs))
        with pytest.raises(ModelStructureError, match=f"one graph in the decoder, found {graphs}"):
            edit_decoder(without.SerializeToString() + extra, lambda view, span: [])


def test_bytes_that_are_no_protobuf_are_a_load_error():
    with pytest.raises(ModelLoadError, match="protobuf cannot be read"):
        edit_decoder(b"\x0a\x05ab", lambda view, span: [])
