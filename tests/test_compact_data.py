"""`save_model` copies of a data file only what the model still references once a pass replaced
weights (when that saves COMPACT_UNREFERENCED_BYTES or more), each tensor at an offset congruent
to its old one modulo a page (64 bytes for a small one); a file with less dead weight is copied
whole, and so is one whose tensors overlap."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_chunk.cli import main
from onnx_chunk.graph import external_data
from onnx_chunk.graph.external_data import bytes_to_copy, external_entries, referenced_ranges
from onnx_chunk.graph.model_io import load_model, save_model
from onnx_chunk.runtime import load
from tests.exports.corpus import GENAI, fixtures

INT4 = next(fixture for fixture in fixtures(GENAI) if fixture.name == "genai-llama-int4")
LARGE_COLUMNS = 1024  # 4 x 1024 float32: 16 KiB, over a page


def _three_weights(folder, dead_floats: int):
    """A model y = x @ large + x @ small + x @ dead, its weights in one data file at offsets
    100, 16484 and 16600 (odd alignments, so their residues are seen); returns the path and
    the kept arrays."""
    rng = np.random.default_rng(0)
    arrays = {"large": rng.standard_normal((4, LARGE_COLUMNS)).astype(np.float32),
              "small": rng.standard_normal((4, 3)).astype(np.float32),
              "dead": rng.standard_normal((4, dead_floats // 4)).astype(np.float32)}
    folder.mkdir()
    data = folder / "model.onnx.data"
    tensors, nodes, outputs = [], [], []
    with data.open("wb") as out:
        out.write(b"\0" * 100)
        for name, array in arrays.items():
            offset = out.tell()
            out.write(array.tobytes())
            out.write(b"\0" * 20)
            tensor = numpy_helper.from_array(array, name)
            tensor.ClearField("raw_data")
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data.name), ("offset", str(offset)),
                               ("length", str(array.nbytes))):
                tensor.external_data.add(key=key, value=value)
            tensors.append(tensor)
            nodes.append(helper.make_node("MatMul", ["x", name], [f"{name}_out"]))
            outputs.append(helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT,
                                                         [1, array.shape[1]]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 4])], outputs, tensors)
    path = folder / "model.onnx"
    onnx.save(helper.make_model(graph), path)
    return path, {name: arrays[name] for name in ("large", "small")}


def _drop_dead(path):
    """The model with its third MatMul, output and weights removed (as a pass replacing them)."""
    model = load_model(path)
    node = next(node for node in model.graph if node.outputs[0].name == "dead_out")
    model.graph.outputs.pop(2)
    model.graph.remove(node, safe=True)
    model.graph.initializers.pop("dead")
    return model


def _offsets(path) -> dict[str, int]:
    proto = onnx.load(path, load_external_data=False)
    return {tensor.name: int({entry.key: entry.value for entry in tensor.external_data}
                             ["offset"]) for tensor in proto.graph.initializer}


def test_replaced_weights_are_left_behind(tmp_path):
    path, kept = _three_weights(tmp_path / "source", dead_floats=1 << 19)  # 2 MiB dead
    model = _drop_dead(path)
    target = tmp_path / "out" / "model.onnx"
    copied: list[int] = []
    useful = sum(array.nbytes for array in kept.values())
    assert bytes_to_copy(model, target) == useful
    save_model(model, target, progress=copied.append)
    assert sum(copied) == useful
    offsets = _offsets(target)
    assert offsets["large"] % 4096 == 100 and offsets["small"] % 64 == (16384 + 120) % 64
    size = target.with_name("model.onnx.data").stat().st_size
    assert size == offsets["small"] + kept["small"].nbytes < 17 * 1024
    loaded = {tensor.name: numpy_helper.to_array(tensor)
              for tensor in onnx.load(target).graph.initializer}
    for name, array in kept.items():
        np.testing.assert_array_equal(loaded[name], array)


def test_a_file_with_little_dead_weight_is_copied_whole(tmp_path):
    path, _ = _three_weights(tmp_path / "source", dead_floats=1024)  # 4 KiB dead
    model = _drop_dead(path)
    target = tmp_path / "out" / "model.onnx"
    whole = (tmp_path / "source" / "model.onnx.data").stat().st_size
    assert bytes_to_copy(model, target) == whole
    save_model(model, target)
    assert target.with_name("model.onnx.data").stat().st_size == whole
    original = _offsets(path)
    assert _offsets(target) == {"large": original["large"], "small": original["small"]}


def test_overlapping_tensors_keep_the_whole_file(tmp_path):
    path, kept = _three_weights(tmp_path / "source", dead_floats=1 << 19)
    model = _drop_dead(path)
    entries = list(external_entries(model))
    assert referenced_ranges(entries, "model.onnx.data") == [
        (100, kept["large"].nbytes), (100 + kept["large"].nbytes + 20, kept["small"].nbytes)]
    proto = onnx.load(path, load_external_data=False)
    small = next(tensor for tensor in proto.graph.initializer if tensor.name == "small")
    for entry in small.external_data:
        if entry.key == "offset":
            entry.value = "104"  # inside "large"
    onnx.save(proto, path)
    overlapping = _drop_dead(path)
    assert referenced_ranges(external_entries(overlapping), "model.onnx.data") is None
    target = tmp_path / "out" / "model.onnx"
    save_model(overlapping, target)
    assert (target.with_name("model.onnx.data").stat().st_size
            == (tmp_path / "source" / "model.onnx.data").stat().st_size)


def test_an_in_place_rewrite_keeps_its_data_file(tmp_path):
    path, _ = _three_weights(tmp_path / "source", dead_floats=1 << 19)
    before = path.with_name("model.onnx.data").stat().st_size
    model = _drop_dead(path)
    assert bytes_to_copy(model, path) == 0
    save_model(model, path)
    assert path.with_name("model.onnx.data").stat().st_size == before


def test_the_default_int8_conversion_runs_the_same_compacted_or_not(tmp_path, monkeypatch,
                                                                    capsys):
    """The corpus's INT4 llama converted with its layers' 4-bit weights replaced by int8 ones,
    compacted (a threshold of one byte) and whole (1 TiB): the same logits."""
    logits, sizes = [], []
    for threshold in (1, 1 << 40):
        monkeypatch.setattr(external_data, "COMPACT_UNREFERENCED_BYTES", threshold)
        out = tmp_path / str(threshold)
        assert main(["convert", str(INT4.folder), "-o", str(out), "-q", "--int8-matmul"]) == 0
        sizes.append((out / "model.onnx.data").stat().st_size)
        with load(out, provider="cpu") as runtime, runtime.open_sequence() as sequence:
            logits.append(np.asarray(sequence.prefill(list(range(3, 40)), all_logits=True)))
    capsys.readouterr()
    assert sizes[0] < sizes[1] == (INT4.folder / "model.onnx.data").stat().st_size
    np.testing.assert_array_equal(logits[0], logits[1])
