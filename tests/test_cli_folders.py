"""Every command takes a model folder, as onnxruntime-genai does (`og.Model(folder)`)."""

from __future__ import annotations

import json

from onnx_chunk.cli import main
from tests.validate.mutations import copy_model


def test_convert_inspect_and_generate_take_a_folder(reference_model, tmp_path, capsys):
    folder = copy_model(reference_model("base"), tmp_path / "model").parent
    assert main(["inspect", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == str(folder / "model.onnx")
    assert main(["convert", str(folder), "-o", str(tmp_path / "conv"), "--chunk-size", "16"]) == 0
    assert (tmp_path / "conv" / "model.onnx").is_file()
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "conv"), "--ids", "5,6,7,8", "--max-new-tokens", "3",
                 "--provider", "cpu", "--json"]) == 0
    from_folder = json.loads(capsys.readouterr().out)["tokens"]
    assert main(["generate", str(tmp_path / "conv" / "model.onnx"), "--ids", "5,6,7,8",
                 "--max-new-tokens", "3", "--provider", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == from_folder


def test_a_folder_whose_config_points_outside_is_refused_by_every_command(reference_model,
                                                                          tmp_path, capsys):
    folder = copy_model(reference_model("base"), tmp_path / "model").parent
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "../other/model.onnx"
    (folder / "genai_config.json").write_text(json.dumps(config))
    copy_model(reference_model("base"), tmp_path / "other")
    for argv in (["inspect", str(folder)], ["validate", str(folder), "--provider", "cpu"],
                 ["convert", str(folder), "-o", str(tmp_path / "out")],
                 ["generate", str(folder), "--ids", "5", "--max-new-tokens", "1"]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error:") and "outside the model's folder" in err, (argv, err)
    assert not (tmp_path / "out").exists()
