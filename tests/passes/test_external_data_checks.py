"""Broken external data and tensors onnx_ir would drop: every command refuses them, one line."""

import onnx
import pytest
from onnx import helper

from onnx_chunk.cli import main
from onnx_chunk.graph.data_types import tensor_nbytes
from tests.passes.test_cli_bad_input import one_error_line, save_external


def _edit_external(path, edit):
    """Apply `edit(fields)` to the external-data fields of `path`'s first initializer."""
    proto = onnx.load(str(path), load_external_data=False)
    tensor = proto.graph.initializer[0]
    fields = {entry.key: entry.value for entry in tensor.external_data}
    edit(fields)
    del tensor.external_data[:]
    for key, value in fields.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    path.write_bytes(proto.SerializeToString())
    return path


def _negative_offset(folder, proto):
    return _edit_external(save_external(proto, folder),
                          lambda fields: fields.update(offset="-8"))


def _length_not_a_number(folder, proto):
    return _edit_external(save_external(proto, folder),
                          lambda fields: fields.update(length="12abc"))


def _length_disagrees_with_shape(folder, proto):
    return _edit_external(save_external(proto, folder),
                          lambda fields: fields.update(length=str(int(fields["length"]) - 4)))


def _no_length_before_other_tensors(folder, proto):
    # The first tensor's bytes run to the end of the file, past its own size.
    return _edit_external(save_external(proto, folder), lambda fields: fields.pop("length"))


def _sparse_initializer(folder, proto):
    values = helper.make_tensor("sparse_w_values", onnx.TensorProto.FLOAT, [1], [1.0])
    indices = helper.make_tensor("sparse_w_indices", onnx.TensorProto.INT64, [1], [0])
    proto.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, [4]))
    return save_external(proto, folder)


def _function_tensor_outside(folder, proto):
    tensor = helper.make_tensor("leak", onnx.TensorProto.UINT8, [16], b"\0" * 16, raw=True)
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "../../etc/passwd"
    constant = helper.make_node("Constant", [], ["c"], value=tensor)
    proto.functions.append(helper.make_function("local", "Leak", [], ["c"], [constant],
                                                [helper.make_opsetid("", 21)]))
    proto.opset_import.append(helper.make_opsetid("local", 1))
    return save_external(proto, folder)


# (builder, words the one error line must hold)
BROKEN = {
    "negative offset": (_negative_offset, "offset '-8' is not a non-negative integer"),
    "length not a number": (_length_not_a_number, "length '12abc' is not a non-negative"),
    "length disagrees with shape": (_length_disagrees_with_shape, "do not match"),
    "no length, bytes to the end": (_no_length_before_other_tensors, "to the end of"),
    "sparse initializer": (_sparse_initializer, "sparse"),
    "function tensor outside": (_function_tensor_outside, "outside the model's folder"),
}

COMMANDS = {
    "convert": lambda path, tmp: ["convert", str(path), "-o", str(tmp / "out")],
    "inspect": lambda path, tmp: ["inspect", str(path)],
    "generate": lambda path, tmp: ["generate", str(path), "--ids", "1,2",
                                   "--max-new-tokens", "1"],
    "validate": lambda path, tmp: ["validate", str(path)],
    "fix-shapes": lambda path, tmp: ["fix-shapes", str(path), "-o", str(tmp / "out"),
                                     "--rows", "4", "--capacity", "16"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_every_command_refuses_broken_external_data(broken, command, tmp_path,
                                                    make_decoder_proto, capsys):
    build, needle = BROKEN[broken]
    path = build(tmp_path / "in", make_decoder_proto())
    code = main(COMMANDS[command](path, tmp_path))
    if command == "validate" and code == 1:
        # validate analyses a graph whose weights are broken, and fails that check.
        captured = capsys.readouterr()
        failed = [line for line in captured.out.splitlines()
                  if line.startswith("structure.external_data") and "failed" in line]
        assert failed and needle in failed[0], captured.out
        assert "Traceback" not in captured.err
    else:
        assert code == 2
        one_error_line(capsys, needle)
    assert not (tmp_path / "out").exists()


def test_convert_in_place_keeps_a_model_with_sparse_initializers(tmp_path, make_decoder_proto,
                                                                 capsys):
    path = _sparse_initializer(tmp_path / "in", make_decoder_proto())
    before = path.read_bytes()
    assert main(["convert", str(path), "--in-place"]) == 2
    one_error_line(capsys, "sparse")
    assert path.read_bytes() == before


@pytest.mark.parametrize(("data_type", "dims", "expected"), [
    (onnx.TensorProto.FLOAT, [3, 5], 60),
    (onnx.TensorProto.FLOAT16, [7], 14),
    (onnx.TensorProto.INT4, [3], 2),
    (onnx.TensorProto.UINT4, [4, 2], 4),
    (onnx.TensorProto.BOOL, [9], 9),
    (onnx.TensorProto.INT64, [], 8),
    (onnx.TensorProto.FLOAT, [0, 4], 0),
    (onnx.TensorProto.STRING, [2], None),
])
def test_tensor_nbytes_follows_dtype_and_shape(data_type, dims, expected):
    assert tensor_nbytes(data_type, tuple(dims)) == expected
