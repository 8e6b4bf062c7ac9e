"""read_model_file: what loading reads of an .onnx file, equal to what onnx reads of it."""

from __future__ import annotations

import onnx
import pytest

from onnx_chunk.cli import main
from onnx_chunk.errors import ModelLoadError
from onnx_chunk.graph.model_file import read_model_file
from onnx_chunk.graph.onnx_wire import encode_len_field, encode_varint_field
from tests.exports.corpus import fixtures


def _dims(value: onnx.ValueInfoProto):
    if not value.type.tensor_type.HasField("shape"):
        return None
    return tuple(dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or None)
                 for dim in value.type.tensor_type.shape.dim)


def _as_onnx_reads_it(path):
    proto = onnx.load(str(path), load_external_data=False)
    graph = proto.graph
    return {
        "ir_version": proto.ir_version,
        "metadata": {entry.key: entry.value for entry in proto.metadata_props},
        "inputs": [(value.name, value.type.tensor_type.elem_type or None, _dims(value))
                   for value in graph.input],
        "outputs": [(value.name, value.type.tensor_type.elem_type or None, _dims(value))
                    for value in graph.output],
        "operators": {(node.domain, node.op_type) for node in graph.node},
        "external": [(tensor.name, tensor.data_type, tuple(tensor.dims),
                      {entry.key: entry.value for entry in tensor.external_data})
                     for tensor in graph.initializer
                     if tensor.data_location == onnx.TensorProto.EXTERNAL],
    }


def _as_read(path):
    model = read_model_file(path)
    return {
        "ir_version": model.ir_version,
        "metadata": model.metadata,
        "inputs": [(value.name, value.elem_type, value.shape) for value in model.inputs],
        "outputs": [(value.name, value.elem_type, value.shape) for value in model.outputs],
        "operators": set(model.operators),
        "external": [(tensor.name, tensor.data_type, tensor.dims, tensor.external)
                     for tensor, _ in model.external_initializers()],
    }


@pytest.mark.parametrize("fixture", fixtures(), ids=str)
def test_the_corpus_reads_as_onnx_reads_it(fixture):
    path = fixture.folder / "model.onnx"
    assert _as_read(path) == _as_onnx_reads_it(path)


def test_a_converted_int4_model_reads_as_onnx_reads_it(reference_model, tmp_path):
    out = tmp_path / "model.onnx"
    assert main(["convert", str(reference_model("int4")), "-o", str(out)]) == 0
    read = _as_read(out)
    assert read == _as_onnx_reads_it(out)
    assert read_model_file(out).uses("MatMulNBits", "com.microsoft")
    assert "onnx_chunk.schema_version" in read["metadata"]


@pytest.mark.parametrize("content", [b"", b"\xff\xfe not a protobuf \x00\x01",
                                     b"hello world\n", b"\x08\x08"])
def test_a_file_that_is_no_model_is_one_clear_error(tmp_path, content):
    path = tmp_path / "model.onnx"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a readable ONNX protobuf|holds no ONNX model") \
            as caught:
        read_model_file(path)
    assert "\n" not in str(caught.value)


def test_a_model_cut_anywhere_is_refused_where_onnx_refuses_it(reference_model, tmp_path):
    data = reference_model().read_bytes()
    path = tmp_path / "model.onnx"
    for cut in range(1, len(data), max(1, len(data) // 97)):
        path.write_bytes(data[:cut])
        try:
            proto = onnx.load(str(path), load_external_data=False)
            onnx_refuses = proto.ir_version == 0 or not proto.HasField("graph")
        except Exception:  # onnx's own parse errors
            onnx_refuses = True
        try:
            read_model_file(path)
            refused = False
        except ModelLoadError as error:
            assert "\n" not in str(error)
            refused = True
        assert refused == onnx_refuses, cut


def test_graphs_nested_too_deep_are_one_clear_error_not_a_recursion_error(tmp_path):
    graph = b""
    for _ in range(400):
        attribute = encode_len_field(1, "then_branch") + encode_len_field(6, graph)
        graph = encode_len_field(1, encode_len_field(4, "If") + encode_len_field(5, attribute))
    path = tmp_path / "model.onnx"
    path.write_bytes(encode_varint_field(1, 8) + encode_len_field(7, graph))
    with pytest.raises(ModelLoadError, match="nest more than") as caught:
        read_model_file(path)
    assert "\n" not in str(caught.value)


def _external_model(tmp_path, dims, *, offset=0, location="weights.bin", data_bytes=64):
    tensor = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=dims)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["w"], ["y"])], "g", [],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], [tensor])
    (tmp_path / "weights.bin").write_bytes(bytes(data_bytes))
    path = tmp_path / "model.onnx"
    path.write_bytes(onnx.helper.make_model(graph).SerializeToString())
    return path


@pytest.mark.parametrize(("dims", "offset", "location", "match"), [
    ([-4], 80, "weights.bin", "none negative"),
    ([2 ** 62] * 5, 0, "weights.bin", "needs bytes up to"),
    ([4], 100, "weights.bin", "past its end"),
    ([4], 0, "weights\x00.bin", "NUL"),
], ids=["negative-dim", "huge-shape", "offset-past-end", "nul-in-location"])
def test_bad_external_tensor_fields_are_one_clear_error(tmp_path, dims, offset, location, match):
    path = _external_model(tmp_path, dims, offset=offset, location=location)
    with pytest.raises(ModelLoadError, match=match) as caught:
        read_model_file(path)
    assert "\n" not in str(caught.value)
