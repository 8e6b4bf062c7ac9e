import json

import onnx
import pytest

from onnx_chunk.cli import main
from onnx_chunk.models.reference import ReferenceDecoder


def test_build_model_prints_path_and_parameter_count(tmp_path, capsys):
    code = main(["build-model", "tiny", "-o", str(tmp_path), "--variant", "conv_hybrid",
                 "--seed", "3", "--layers", "3", "--hidden", "96", "--heads", "6",
                 "--kv-heads", "3", "--vocab", "300", "--intermediate", "160",
                 "--max-positions", "512"])
    out = capsys.readouterr().out
    assert code == 0
    assert str(tmp_path / "model.onnx") in out
    ref = ReferenceDecoder.from_model_dir(tmp_path)
    assert f"parameters: {ref.config.parameter_count():,}" in out
    assert (ref.config.num_layers, ref.config.hidden_size, ref.config.head_size,
            ref.config.num_kv_heads, ref.config.vocab_size, ref.config.max_positions,
            ref.config.conv_layers) == (3, 96, 16, 3, 300, 512, (0, 2))
    genai = json.loads((tmp_path / "genai_config.json").read_text())
    assert genai["model"]["context_length"] == 512


@pytest.mark.parametrize("args, fragment", [
    (["nope"], "unknown preset 'nope'"),
    (["tiny", "--variant", "fp8"], "unknown variant 'fp8'"),
    (["tiny", "--heads", "4", "--kv-heads", "3"], "must divide"),
    (["tiny", "--layers", "0"], "num_layers must be a positive integer"),
])
def test_bad_requests_give_one_error_line(tmp_path, capsys, args, fragment):
    code = main(["build-model", *args[:1], "-o", str(tmp_path / "m"), *args[1:]])
    err = capsys.readouterr().err
    assert code != 0
    assert err.startswith("error: ") and fragment in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m" / "model.onnx").exists()


def test_unwritable_output_is_an_error_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = main(["build-model", "tiny", "-o", str(blocker / "sub")])
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("error: cannot write the model into")


def test_build_model_static_variant(tmp_path, capsys):
    assert main(["build-model", "tiny", "-o", str(tmp_path), "--variant", "static",
                 "--chunk-size", "4", "--capacity", "32"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "model.onnx") in out and str(tmp_path / "decode.onnx") in out
    for name, rows in (("model.onnx", 4), ("decode.onnx", 1)):
        model = onnx.load(str(tmp_path / name), load_external_data=False)
        dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim]
                for i in model.graph.input}
        assert dims["input_ids"] == [1, rows]
        assert dims["past_key_values.0.key"][2] == 32
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "decode.onnx", "model.onnx", "model.onnx.data"]


def test_build_model_static_needs_sizes(tmp_path, capsys):
    assert main(["build-model", "tiny", "-o", str(tmp_path), "--variant", "static"]) == 2
    assert "needs --chunk-size and --capacity" in capsys.readouterr().err
    assert main(["build-model", "tiny", "-o", str(tmp_path), "--capacity", "8"]) == 2
    capsys.readouterr()
    assert main(["build-model", "tiny", "-o", str(tmp_path), "--variant", "static",
                 "--chunk-size", "1", "--capacity", "8"]) == 2
    assert "c >= 2" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
