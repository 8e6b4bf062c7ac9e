import json
import os

import onnx
import pytest

from onnx_chunk.cli import main
from onnx_chunk.graph import metadata
from onnx_chunk.graph.model_io import save_model
from onnx_chunk.ladder import ladder_tiers


@pytest.fixture
def model_file(tmp_path, make_decoder):
    def write(folder="in", **options):
        path = tmp_path / folder / "model.onnx"
        save_model(make_decoder(**options), path)
        return path
    return write


def _inspect_json(path, capsys):
    assert main(["inspect", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_convert_writes_annotated_model_and_summary(model_file, tmp_path, capsys):
    source = model_file(layers=2)
    out = tmp_path / "out" / "model.onnx"
    assert main(["convert", str(source), "-o", str(out), "--chunk-size", "300"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "100, 200, 300" in printed
    plan = metadata.read_plan(onnx.load(str(out)))
    assert (plan.chunk_size, plan.ladder, plan.gqa_nodes) == (300, (100, 200, 300), 2)
    assert metadata.read_plan(onnx.load(str(source))) is None
    assert [name for name in os.listdir(out.parent) if name.startswith(".")] == []


def test_convert_into_a_folder_keeps_the_file_name(model_file, tmp_path, capsys):
    source = model_file()
    assert main(["convert", str(source), "-o", str(tmp_path / "outdir")]) == 0
    assert (tmp_path / "outdir" / "model.onnx").is_file()


def test_convert_refuses_to_overwrite_the_input(model_file, capsys):
    source = model_file()
    before = source.read_bytes()
    assert main(["convert", str(source), "-o", str(source)]) == 2
    assert "--in-place" in capsys.readouterr().err
    assert source.read_bytes() == before


def test_convert_needs_an_output(model_file, capsys):
    assert main(["convert", str(model_file())]) == 2
    assert "-o OUT" in capsys.readouterr().err


def test_in_place_twice_writes_once(model_file, capsys):
    source = model_file()
    assert main(["convert", str(source), "--in-place"]) == 0
    converted = source.read_bytes()
    mtime = source.stat().st_mtime_ns
    assert main(["convert", str(source), "--in-place"]) == 0
    assert "already converted" in capsys.readouterr().out
    assert source.read_bytes() == converted and source.stat().st_mtime_ns == mtime
    assert main(["convert", str(source), "--in-place", "--max-variants", "3"]) == 0
    assert metadata.read_plan(onnx.load(str(source))).ladder == (256, 512)


def test_convert_model_without_gqa_fails_cleanly(model_file, tmp_path, capsys):
    source = model_file(gqa=False)
    out = tmp_path / "out" / "model.onnx"
    assert main(["convert", str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert "KV capacity annotation does not apply" in err and "whole-prompt" in err
    assert not out.exists()


@pytest.mark.parametrize("content,needle", [(None, "does not exist"),
                                            (b"garbage\x00\xff", "ONNX")])
def test_convert_bad_input_is_one_line(tmp_path, capsys, content, needle):
    path = tmp_path / "model.onnx"
    if content is not None:
        path.write_bytes(content)
    assert main(["convert", str(path), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_inspect_unconverted_model(model_file, capsys):
    data = _inspect_json(model_file(layers=2, position_ids="position_ids"), capsys)
    assert data["converted"] is False and data["chunk_size"] is None and data["ladder"] == []
    assert data["gqa_nodes"] == 2 and len(data["capacity_inputs"]) == 4
    assert data["per_token_ports"] == ["input_ids", "position_ids"]
    assert data["recurrent_state"] == [] and data["max_variants"] == 4
    assert data["padding"] == {"eligible": True, "reasons": []}


def test_inspect_converted_model_shows_its_declaration(model_file, tmp_path, capsys):
    out = tmp_path / "out" / "model.onnx"
    assert main(["convert", str(model_file()), "-o", str(out), "--max-variants", "5"]) == 0
    capsys.readouterr()
    data = _inspect_json(out, capsys)
    assert data["converted"] is True
    assert (data["chunk_size"], data["ladder"], data["max_variants"]) == (512, [128, 256, 384,
                                                                               512], 5)


def test_inspect_text_names_the_reasons(model_file, capsys):
    from onnx import TensorProto

    path = model_file(extra_inputs=(("row_scale", TensorProto.FLOAT, ["sequence_length"]),))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "not converted" in out and "padding: not eligible" in out and "'row_scale'" in out


def _is_str_list(value):
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


# Every key `inspect --json` promises, with the check of its type.
REQUIRED_KEYS = {
    "gqa_nodes": lambda value: type(value) is int,
    "capacity_inputs": _is_str_list,
    "per_token_ports": _is_str_list,
    "recurrent_state": _is_str_list,
    "padding": lambda value: (isinstance(value, dict) and set(value) == {"eligible", "reasons"}
                              and type(value["eligible"]) is bool
                              and _is_str_list(value["reasons"])),
    "chunk_size": lambda value: value is None or type(value) is int,
    "ladder": lambda value: isinstance(value, list) and all(type(t) is int for t in value),
    "max_variants": lambda value: type(value) is int,
}


def test_inspect_json_schema(model_file, tmp_path, capsys):
    from onnx import TensorProto

    conv = ["batch_size", 16, 2]
    hybrid = model_file("hybrid", extra_inputs=(("past.0.conv", TensorProto.FLOAT, conv),),
                        extra_outputs=(("present.0.conv", TensorProto.FLOAT, conv),))
    converted = tmp_path / "converted" / "model.onnx"
    assert main(["convert", str(hybrid), "-o", str(converted), "--chunk-size", "64"]) == 0
    capsys.readouterr()
    models = {"converted": converted, "unconverted": model_file("plain", layers=2),
              "no GQA": model_file("nogqa", gqa=False)}
    seen = {name: _inspect_json(path, capsys) for name, path in models.items()}
    for name, data in seen.items():
        for key, valid in REQUIRED_KEYS.items():
            assert key in data, f"{name}: {key} missing"
            assert valid(data[key]), f"{name}: {key} = {data[key]!r}"
    assert seen["converted"]["chunk_size"] == 64
    assert seen["converted"]["ladder"] == list(ladder_tiers(64, 4))
    assert seen["converted"]["recurrent_state"] == ["past.0.conv"]
    assert seen["converted"]["padding"]["eligible"] is False
    assert seen["unconverted"]["capacity_inputs"] == [
        f"past_key_values.{layer}.{kind}" for layer in range(2) for kind in ("key", "value")]
    assert seen["unconverted"]["chunk_size"] is None and seen["unconverted"]["ladder"] == []
    assert seen["no GQA"]["gqa_nodes"] == 0 and seen["no GQA"]["capacity_inputs"] == []
    assert seen["no GQA"]["padding"]["eligible"] is False
