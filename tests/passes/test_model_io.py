import os

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from onnx_chunk.errors import ModelLoadError
from onnx_chunk.graph.external_data import external_data_files
from onnx_chunk.graph.model_io import (
    load_model,
    save_model,
    write_to_data_file,
)


def _external_model(folder, location="weights.data", offset=0, write_data=True):
    """A one-initializer model whose 4 KiB weight lives in external data at `location`."""
    weight = np.arange(1024, dtype=np.float32)
    tensor = numpy_helper.from_array(weight, "w")
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)),
                       ("length", str(weight.nbytes))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1024])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1024])],
        initializer=[tensor])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    if write_data:
        (folder / location).write_bytes(b"\0" * offset + weight.tobytes())
    return path, weight


def test_load_keeps_external_data_lazy(tmp_path):
    path, weight = _external_model(tmp_path)
    model = load_model(path)
    tensor = model.graph.initializers["w"].const_value
    assert tensor.__class__.__name__ == "ExternalTensor"
    assert external_data_files(model) == {"weights.data": (tmp_path / "weights.data").resolve()}
    np.testing.assert_array_equal(tensor.numpy(), weight)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope.onnx")


def test_folder_instead_of_file(tmp_path):
    with pytest.raises(ModelLoadError, match="is a folder"):
        load_model(tmp_path)


@pytest.mark.parametrize("content", [b"\xff\xfe not a protobuf \x00\x01", b"hello world\n"])
def test_not_a_protobuf(tmp_path, content):
    path = tmp_path / "model.onnx"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="model"):
        load_model(path)


def test_truncated_file(tmp_path):
    path, _ = _external_model(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(path)


def test_external_data_missing(tmp_path):
    path, _ = _external_model(tmp_path, write_data=False)
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(path)


def test_external_data_outside_the_folder(tmp_path):
    (tmp_path / "secret.data").write_bytes(b"\0" * 8192)
    path, _ = _external_model(tmp_path / "m", location="../secret.data", write_data=False)
    with pytest.raises(ModelLoadError, match="outside the model's folder"):
        load_model(path)


def test_external_data_too_short(tmp_path):
    path, _ = _external_model(tmp_path)
    (tmp_path / "weights.data").write_bytes(b"\0" * 100)
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(path)


def test_save_copies_external_data_and_keeps_it_external(tmp_path):
    path, weight = _external_model(tmp_path / "in", offset=64)
    model = load_model(path)
    seen = []
    save_model(model, tmp_path / "out" / "model.onnx", progress=seen.append)
    out = tmp_path / "out"
    # The one data file is named after the output, its tensors' offsets kept.
    assert sorted(os.listdir(out)) == ["model.onnx", "model.onnx.data"]
    assert sum(seen) == (tmp_path / "in" / "weights.data").stat().st_size
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert proto.graph.initializer[0].data_location == onnx.TensorProto.EXTERNAL
    reloaded = load_model(out / "model.onnx")
    np.testing.assert_array_equal(reloaded.graph.initializers["w"].const_value.numpy(), weight)


def test_save_in_place_rewrites_only_the_graph(tmp_path):
    path, weight = _external_model(tmp_path)
    data_before = (tmp_path / "weights.data").stat()
    model = load_model(path)
    model.metadata_props["k"] = "v"
    seen = []
    save_model(model, path, progress=seen.append)
    assert seen == []
    assert (tmp_path / "weights.data").stat().st_ino == data_before.st_ino
    assert sorted(os.listdir(tmp_path)) == ["model.onnx", "weights.data"]
    reloaded = load_model(path)
    assert reloaded.metadata_props["k"] == "v"
    np.testing.assert_array_equal(reloaded.graph.initializers["w"].const_value.numpy(), weight)


def _add_initializer(model, name, array, marked):
    value = ir.Value(name=name, shape=ir.Shape(array.shape),
                     type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     const_value=ir.tensor(array, name=name))
    model.graph.register_initializer(value)
    if marked:
        write_to_data_file(value)


def _locations(path):
    proto = onnx.load(str(path), load_external_data=False)
    return {tensor.name: next((entry.value for entry in tensor.external_data
                               if entry.key == "location"), None)
            for tensor in proto.graph.initializer}


def test_weights_marked_for_a_data_file_are_written_beside_the_model(tmp_path):
    """New weights go to `<name>.weights.data` (ONNX Runtime maps them and unmaps what it
    packs); a small marked tensor and an unmarked one stay inside the .onnx; a second write
    in place takes a name the model does not reference yet."""
    path, weight = _external_model(tmp_path / "in")
    model = load_model(path)
    big = np.arange(3 << 20, dtype=np.int64).astype(np.int8).reshape(3, -1)
    small = np.arange(8, dtype=np.float32)
    _add_initializer(model, "big", big, marked=True)
    _add_initializer(model, "small", small, marked=True)
    _add_initializer(model, "unmarked", big[:1], marked=False)
    target = tmp_path / "out" / "model.onnx"
    save_model(model, target)
    assert sorted(os.listdir(target.parent)) == [
        "model.onnx", "model.onnx.data", "model.onnx.weights.data"]
    assert _locations(target) == {"w": "model.onnx.data", "big": "model.onnx.weights.data",
                                  "small": None, "unmarked": None}
    reloaded = load_model(target)
    for name, array in (("w", weight), ("big", big), ("small", small), ("unmarked", big[:1])):
        np.testing.assert_array_equal(reloaded.graph.initializers[name].const_value.numpy(),
                                      array)
    _add_initializer(reloaded, "again", big[1:], marked=True)
    save_model(reloaded, target)
    assert _locations(target)["again"] == "model.onnx.weights-2.data"
    again = load_model(target)
    np.testing.assert_array_equal(again.graph.initializers["big"].const_value.numpy(), big)
    np.testing.assert_array_equal(again.graph.initializers["again"].const_value.numpy(),
                                  big[1:])


def test_save_copies_the_data_of_function_local_tensors(tmp_path):
    # A model-local function whose Constant keeps its tensor in external data.
    weight = np.arange(16, dtype=np.float32)
    tensor = numpy_helper.from_array(weight, "k")
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "k.bin"), ("offset", "0"), ("length", "64")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    function = helper.make_function(
        "local", "AddK", ["x"], ["y"],
        [helper.make_node("Constant", [], ["k"], value=tensor),
         helper.make_node("Add", ["x", "k"], ["y"])], [helper.make_opsetid("", 21)])
    graph = helper.make_graph(
        [helper.make_node("AddK", ["x"], ["y"], domain="local")], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [16])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [16])])
    proto = helper.make_model(graph, functions=[function], ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("local", 1)])
    (tmp_path / "in").mkdir()
    onnx.save(proto, str(tmp_path / "in" / "model.onnx"))
    (tmp_path / "in" / "k.bin").write_bytes(weight.tobytes())
    save_model(load_model(tmp_path / "in" / "model.onnx"), tmp_path / "out" / "f.onnx")
    assert sorted(os.listdir(tmp_path / "out")) == ["f.onnx", "f.onnx.data"]
    session = ort.InferenceSession(str(tmp_path / "out" / "f.onnx"),
                                   providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"x": np.zeros(16, np.float32)})[0], weight)
