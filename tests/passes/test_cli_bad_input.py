"""Bad inputs and failed writes through `onnx-chunk convert` and `onnx-chunk inspect`."""

import errno
import os

import onnx
import pytest
from onnx import helper

from onnx_chunk.cli import main
from onnx_chunk.graph import model_io

DATA = "model.onnx.data"


def save_external(proto, folder):
    """Save `proto` with every initializer in one external data file beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=DATA, size_threshold=0)
    return path


def _truncated_model(folder, proto):
    path = save_external(proto, folder)
    content = path.read_bytes()
    path.write_bytes(content[: len(content) // 2])
    return path


def _data_missing(folder, proto):
    path = save_external(proto, folder)
    (folder / DATA).unlink()
    return path


def _data_short(folder, proto):
    path = save_external(proto, folder)
    data = folder / DATA
    data.write_bytes(data.read_bytes()[:-64])
    return path


def _data_outside(folder, proto):
    path = save_external(proto, folder)
    (folder / DATA).rename(folder.parent / DATA)
    saved = onnx.load(str(path), load_external_data=False)
    for tensor in saved.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = f"../{DATA}"
    path.write_bytes(saved.SerializeToString())
    return path


def _old_opset(folder, proto_factory):
    return save_external(proto_factory(opsets={"": 5, "com.microsoft": 1}), folder)


def _unknown_domain(folder, proto_factory):
    node = helper.make_node("Mystery", ["input_ids"], ["mystery_out"], domain="com.example")
    return save_external(proto_factory(extra_nodes=(node,),
                                        opsets={"": 21, "com.microsoft": 1, "com.example": 1}),
                          folder)


# (builder, words the one error line must hold)
BAD_INPUTS = {
    "truncated": (_truncated_model, "truncated"),
    "data missing": (_data_missing, "missing"),
    "data short": (_data_short, "truncated"),
    "data outside": (_data_outside, "outside the model's folder"),
    "old opset": (_old_opset, "opset 5"),
    "unknown domain": (_unknown_domain, "'com.example'"),
}


@pytest.fixture(params=sorted(BAD_INPUTS))
def bad_model(request, tmp_path, make_decoder_proto):
    build, needle = BAD_INPUTS[request.param]
    argument = make_decoder_proto if request.param in ("old opset", "unknown domain") \
        else make_decoder_proto()
    return build(tmp_path / "in", argument), needle


def one_error_line(capsys, needle):
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in captured.err + captured.out
    assert needle in err
    return err


def test_convert_refuses_bad_input_without_output(bad_model, tmp_path, capsys):
    path, needle = bad_model
    out = tmp_path / "out"
    assert main(["convert", str(path), "-o", str(out)]) == 2
    one_error_line(capsys, needle)
    assert not out.exists()


def test_inspect_refuses_bad_input(bad_model, capsys):
    path, needle = bad_model
    assert main(["inspect", str(path), "--json"]) == 2
    one_error_line(capsys, needle)
    assert capsys.readouterr().out == ""


def test_model_without_gqa(tmp_path, make_decoder_proto, capsys):
    path = save_external(make_decoder_proto(gqa=False), tmp_path / "in")
    out = tmp_path / "out"
    assert main(["convert", str(path), "-o", str(out)]) == 2
    err = one_error_line(capsys, "KV capacity annotation does not apply")
    assert "whole-prompt prefill" in err
    assert not out.exists()
    assert main(["inspect", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "GQA nodes: 0" in printed and "padding: not eligible" in printed
    assert "no com.microsoft::GroupQueryAttention" in printed


def _with_companions(folder, proto):
    path = save_external(proto, folder)
    (folder / "genai_config.json").write_text("{}\n")
    (folder / "tokenizer.json").write_text("{}\n")
    return path


@pytest.mark.parametrize("existing_out", [False, True])
def test_failed_write_leaves_the_output_folder_untouched(tmp_path, make_decoder_proto, capsys,
                                                         monkeypatch, existing_out):
    source = _with_companions(tmp_path / "in", make_decoder_proto())
    out = tmp_path / "out"
    if existing_out:
        out.mkdir()
        (out / "keep.txt").write_text("mine")

    def disk_full(model, target):
        assert (target.parent / DATA).is_file() and (target.parent / "tokenizer.json").is_file()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(model_io, "write_proto", disk_full)
    assert main(["convert", str(source), "-o", str(out)]) == 2
    one_error_line(capsys, "No space left")
    if existing_out:
        assert os.listdir(out) == ["keep.txt"]
    else:
        assert not out.exists()
    assert sorted(os.listdir(tmp_path / "in")) == sorted(["model.onnx", DATA,
                                                          "genai_config.json",
                                                          "tokenizer.json"])


def test_convert_writes_data_and_companions(tmp_path, make_decoder_proto, capsys):
    source = _with_companions(tmp_path / "in", make_decoder_proto())
    out = tmp_path / "out"
    assert main(["convert", str(source), "-o", str(out)]) == 0
    assert "(with genai_config.json, tokenizer.json)" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == sorted(["model.onnx", DATA, "genai_config.json",
                                              "tokenizer.json"])
    assert (out / DATA).read_bytes() == (tmp_path / "in" / DATA).read_bytes()
    onnx.checker.check_model(str(out / "model.onnx"))


def test_in_place_copies_no_data(tmp_path, make_decoder_proto, capsys):
    source = _with_companions(tmp_path / "in", make_decoder_proto())
    data = tmp_path / "in" / DATA
    inode = data.stat().st_ino
    assert main(["convert", str(source), "--in-place"]) == 0
    assert data.stat().st_ino == inode
    assert sorted(os.listdir(tmp_path / "in")) == sorted(["model.onnx", DATA,
                                                          "genai_config.json",
                                                          "tokenizer.json"])
    assert "onnx_chunk.schema_version" in {p.key for p in onnx.load(
        str(source), load_external_data=False).metadata_props}
