"""`save_model` copies of a data file only what the model still references once a pass replaced
weights (COMPACT_UNREFERENCED_BYTES or more unreferenced), each tensor at an offset congruent
to its old one modulo a page; a file with less dead weight is copied whole."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_chunk.cli import main
from onnx_chunk.graph import external_data
from onnx_chunk.graph.external_data import bytes_to_copy, referenced_ranges
from onnx_chunk.graph.model_io import load_model, save_model
from onnx_chunk.runtime import load
from tests.exports.corpus import GENAI, fixtures

INT4 = next(fixture for fixture in fixtures(GENAI) if fixture.name == "genai-llama-int4")


def _two_weights(folder, dead_floats: int):
    """A model y = x @ kept + x @ dead, its weights in one data file ("kept" first, at offset
    100 so its alignment is odd); returns the path."""
    rng = np.random.default_rng(0)
    kept = rng.standard_normal((4, 3)).astype(np.float32)
    dead = rng.standard_normal((4, dead_floats // 4)).astype(np.float32)
    folder.mkdir()
    data = folder / "model.onnx.data"
    tensors = []
    with data.open("wb") as out:
        out.write(b"\0" * 100)
        for name, array in (("kept", kept), ("dead", dead)):
            offset = out.tell()
            out.write(array.tobytes())
            tensor = numpy_helper.from_array(array, name)
            tensor.ClearField("raw_data")
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data.name), ("offset", str(offset)),
                               ("length", str(array.nbytes))):
                tensor.external_data.add(key=key, value=value)
            tensors.append(tensor)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "kept"], ["y"]),
         helper.make_node("MatMul", ["x", "dead"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, dead.shape[1]])], tensors)
    path = folder / "model.onnx"
    onnx.save(helper.make_model(graph), path)
    return path, kept


def _drop_dead(path):
    """The model with its second MatMul, output and weights removed (as a pass replacing them)."""
    model = load_model(path)
    node = next(node for node in model.graph if node.outputs[0].name == "z")
    model.graph.outputs.pop(1)
    model.graph.remove(node, safe=True)
    model.graph.initializers.pop("dead")
    return model


def _offset(path, name) -> int:
    proto = onnx.load(path, load_external_data=False)
    tensor = next(tensor for tensor in proto.graph.initializer if tensor.name == name)
    return int({entry.key: entry.value for entry in tensor.external_data}["offset"])


def test_replaced_weights_are_left_behind(tmp_path):
    path, kept = _two_weights(tmp_path / "source", dead_floats=1 << 19)  # 2 MiB dead
    model = _drop_dead(path)
    target = tmp_path / "out" / "model.onnx"
    copied: list[int] = []
    assert bytes_to_copy(model, target) == kept.nbytes
    save_model(model, target, progress=copied.append)
    assert sum(copied) == kept.nbytes
    data = target.with_name("model.onnx.data")
    assert data.stat().st_size == 100 + kept.nbytes  # the odd offset kept modulo a page
    assert _offset(target, "kept") % 4096 == 100
    loaded = onnx.load(target)
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), kept)


def test_a_file_with_little_dead_weight_is_copied_whole(tmp_path):
    path, _ = _two_weights(tmp_path / "source", dead_floats=1024)  # 4 KiB dead
    model = _drop_dead(path)
    target = tmp_path / "out" / "model.onnx"
    whole = (tmp_path / "source" / "model.onnx.data").stat().st_size
    assert bytes_to_copy(model, target) == whole
    save_model(model, target)
    assert target.with_name("model.onnx.data").stat().st_size == whole
    assert _offset(target, "kept") == 100


def test_overlapping_tensors_keep_the_whole_file(tmp_path):
    path, _ = _two_weights(tmp_path / "source", dead_floats=1 << 19)
    model = _drop_dead(path)
    kept = model.graph.initializers["kept"].const_value
    assert referenced_ranges(model, "model.onnx.data") == [(100, kept.nbytes)]
    overlapping = onnx.load(path, load_external_data=False)
    dead = next(tensor for tensor in overlapping.graph.initializer if tensor.name == "dead")
    for entry in dead.external_data:
        if entry.key == "offset":
            entry.value = "104"  # inside "kept"
    onnx.save(overlapping, path)
    assert referenced_ranges(load_model(path), "model.onnx.data") is None


def test_the_default_int8_conversion_runs_the_same_compacted_or_not(tmp_path, monkeypatch,
                                                                    capsys):
    """The corpus's INT4 llama converted by default (its layers' 4-bit weights replaced by
    int8 ones), compacted (a threshold of one byte) and whole (1 TiB): the same logits."""
    logits, sizes = [], []
    for threshold in (1, 1 << 40):
        monkeypatch.setattr(external_data, "COMPACT_UNREFERENCED_BYTES", threshold)
        out = tmp_path / str(threshold)
        assert main(["convert", str(INT4.folder), "-o", str(out), "-q"]) == 0
        sizes.append((out / "model.onnx.data").stat().st_size)
        with load(out, provider="cpu") as runtime, runtime.open_sequence() as sequence:
            logits.append(np.asarray(sequence.prefill(list(range(3, 40)), all_logits=True)))
    capsys.readouterr()
    assert sizes[0] < sizes[1] == (INT4.folder / "model.onnx.data").stat().st_size
    np.testing.assert_array_equal(logits[0], logits[1])
