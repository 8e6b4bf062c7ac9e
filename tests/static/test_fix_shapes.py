"""`fix-shapes`: a dynamic GQA decoder into fixed chunk and decode graphs on shared weights."""

from __future__ import annotations

import os
import shutil
import stat

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_chunk.cli import main
from onnx_chunk.errors import ConfigError, ModelLoadError, ModelStructureError, OutputError
from onnx_chunk.static.fix_shapes import fix_shapes

from .static_sizes import CPU, SEED

ROWS, CAPACITY = 4, 24


@pytest.fixture
def dynamic_copy(dynamic_models, tmp_path):
    model = dynamic_models(SEED)
    source = tmp_path / "dynamic"
    shutil.copytree(model.parent, source)
    return source / model.name


def _shapes(path):
    model = onnx.load(path, load_external_data=False)
    return {value.name: [dim.dim_value if dim.HasField("dim_value") else dim.dim_param
                         for dim in value.type.tensor_type.shape.dim]
            for value in list(model.graph.input) + list(model.graph.output)}


def _greedy_on_fixed_graphs(chunk_path, decode_path, prompt, max_new):
    """Chunked prefill and decode on the fixed graphs: past bound at capacity, a capacity-wide
    attention mask with ones on the positions written so far."""
    chunk = ort.InferenceSession(str(chunk_path), providers=CPU)
    decode = ort.InferenceSession(str(decode_path), providers=CPU)
    names = [port.name for port in chunk.get_outputs()]
    past = {port.name: np.zeros(port.shape, np.float32) for port in chunk.get_inputs()
            if port.name.startswith("past_key_values.")}

    def step(session, ids, length):
        mask = np.zeros((1, CAPACITY), np.int64)
        mask[0, :length] = 1
        outputs = dict(zip(names, session.run(None, {"input_ids": np.array([ids]),
                                                     "attention_mask": mask, **past})))
        past.update({name: outputs[name.replace("past_key_values", "present")] for name in past})
        return outputs["logits"][0, -1]

    for start in range(0, len(prompt), ROWS):
        logits = step(chunk, prompt[start:start + ROWS], start + ROWS)
    tokens = [int(logits.argmax())]
    while len(tokens) < max_new:
        tokens.append(int(step(decode, [tokens[-1]], len(prompt) + len(tokens)).argmax()))
    return tokens


def test_fixed_graphs_have_no_free_dims_share_data_and_generate_like_the_dynamic_model(
        dynamic_copy, tmp_path, dynamic_greedy):
    result = fix_shapes(dynamic_copy, tmp_path / "fixed", rows=ROWS, capacity=CAPACITY)
    shutil.rmtree(dynamic_copy.parent)  # the fixed graphs must not depend on the source
    chunk, decode = _shapes(result.chunk_model), _shapes(result.decode_model)
    for shapes in (chunk, decode):
        assert all(isinstance(dim, int) for shape in shapes.values() for dim in shape)
    assert chunk["input_ids"] == [1, ROWS] and decode["input_ids"] == [1, 1]
    assert chunk["attention_mask"] == decode["attention_mask"] == [1, CAPACITY]
    assert chunk["past_key_values.0.key"] == [1, 2, CAPACITY, 16]
    assert chunk["logits"] == [1, ROWS, 256] and decode["logits"] == [1, 1, 256]
    assert result.free_outputs == []
    assert [path.name for path in result.data_files] == ["model.onnx.data"]
    assert sorted(p.name for p in result.chunk_model.parent.iterdir()) == \
        ["chunk.onnx", "decode.onnx", "model.onnx.data"]
    prompt = np.random.default_rng(4).integers(3, 256, 3 * ROWS).tolist()
    assert _greedy_on_fixed_graphs(result.chunk_model, result.decode_model, prompt, 8) == \
        dynamic_greedy(SEED, prompt, 8)
    session = ort.InferenceSession(str(result.chunk_model), providers=CPU)
    with pytest.raises(Exception, match="input_ids"):
        session.run(["logits"], {"input_ids": np.zeros((1, ROWS + 1), np.int64)})


def test_the_copied_data_keeps_the_sources_permission_bits(dynamic_copy, tmp_path):
    os.chmod(dynamic_copy.parent / "model.onnx.data", 0o600)
    result = fix_shapes(dynamic_copy, tmp_path / "fixed", rows=ROWS, capacity=CAPACITY)
    assert [stat.S_IMODE(path.stat().st_mode) for path in result.data_files] == [0o600]


def test_free_capacity_needs_a_value_and_other_dims_can_be_named(dynamic_copy, tmp_path):
    with pytest.raises(ConfigError, match="--capacity"):
        fix_shapes(dynamic_copy, tmp_path / "a", rows=ROWS)
    result = fix_shapes(dynamic_copy, tmp_path / "b", rows=ROWS,
                        dims={"past_sequence_length": 32, "total_sequence_length": 32})
    assert _shapes(result.decode_model)["past_key_values.1.value"] == [1, 2, 32, 16]
    with pytest.raises(ConfigError, match="at least 2"):
        fix_shapes(dynamic_copy, tmp_path / "c", rows=1, capacity=CAPACITY)
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_missing_inputs_and_missing_data_are_typed_errors(dynamic_copy, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        fix_shapes(tmp_path / "none.onnx", tmp_path / "out", rows=ROWS, capacity=CAPACITY)
    (dynamic_copy.parent / "model.onnx.data").unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        fix_shapes(dynamic_copy, tmp_path / "out", rows=ROWS, capacity=CAPACITY)
    bare = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n"])]))
    onnx.save(bare, tmp_path / "bare.onnx")
    with pytest.raises(ModelStructureError, match="input_ids"):
        fix_shapes(tmp_path / "bare.onnx", tmp_path / "out", rows=ROWS, capacity=CAPACITY)


def test_cli_writes_both_graphs_and_reports_errors_on_one_line(dynamic_copy, tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(["fix-shapes", str(dynamic_copy), "-o", str(out), "--rows", str(ROWS),
                 "--capacity", str(CAPACITY)])
    printed = capsys.readouterr().out
    assert code == 0
    assert f"{out / 'chunk.onnx'} (rows {ROWS})" in printed
    assert f"past_sequence_length={CAPACITY}" in printed and "sequence_length=4" in printed
    assert (out / "decode.onnx").is_file() and (out / "model.onnx.data").is_file()
    code = main(["fix-shapes", str(dynamic_copy), "-o", str(out), "--rows", str(ROWS)])
    error = capsys.readouterr().err
    assert code == 2 and error.startswith("error: ") and "--capacity" in error
    assert error.count("\n") == 1
    code = main(["fix-shapes", str(dynamic_copy), "-o", str(out), "--rows", "4",
                 "--dim", "past_sequence_length"])
    assert code == 2 and "NAME=VALUE" in capsys.readouterr().err


def test_external_data_escaping_by_symlink_or_truncated_is_refused(dynamic_copy, tmp_path):
    data = dynamic_copy.parent / "model.onnx.data"
    outside = tmp_path / "elsewhere.data"
    data.rename(outside)
    data.symlink_to(outside)
    with pytest.raises(ModelLoadError, match="outside the model's folder"):
        fix_shapes(dynamic_copy, tmp_path / "out", rows=ROWS, capacity=CAPACITY)
    data.unlink()
    size = outside.stat().st_size
    with outside.open("rb") as source:
        data.write_bytes(source.read(size // 2))
    with pytest.raises(ModelLoadError, match="truncated"):
        fix_shapes(dynamic_copy, tmp_path / "out", rows=ROWS, capacity=CAPACITY)
    assert not (tmp_path / "out").exists()


def test_a_failure_while_writing_leaves_no_output(dynamic_copy, tmp_path, monkeypatch):
    from pathlib import Path

    real_write = Path.write_bytes

    def failing_write(path, data):
        if path.name == "decode.onnx":
            raise OSError(28, "No space left on device")
        return real_write(path, data)

    monkeypatch.setattr(Path, "write_bytes", failing_write)
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(OutputError, match="No space left"):
        fix_shapes(dynamic_copy, existing, rows=ROWS, capacity=CAPACITY)
    assert list(existing.iterdir()) == []
    created = tmp_path / "new" / "out"  # on a full disk the folders it created go too
    code = main(["fix-shapes", str(dynamic_copy), "-o", str(created), "--rows", str(ROWS),
                 "--capacity", str(CAPACITY)])
    assert code == 2 and not (tmp_path / "new").exists()


def _listing(folder):
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def _refused(capsys, model, out, *extra) -> str:
    """Run `fix-shapes MODEL -o OUT --rows ROWS --capacity CAPACITY EXTRA...`, expect exit 2
    with one error line, and return it."""
    code = main(["fix-shapes", str(model), "-o", str(out), "--rows", str(ROWS),
                 "--capacity", str(CAPACITY), *extra])
    error = capsys.readouterr().err
    assert code == 2 and error.startswith("error: ") and error.count("\n") == 1
    return error


def test_a_dim_on_the_rows_conflicts_with_rows_and_the_report_reads_the_written_graphs(
        dynamic_copy, tmp_path, capsys):
    out = tmp_path / "out"
    assert "--rows" in _refused(capsys, dynamic_copy, out, "--dim", "sequence_length=8")
    assert not out.exists()
    with pytest.raises(ConfigError, match="batch"):
        fix_shapes(dynamic_copy, out, rows=ROWS, capacity=CAPACITY, dims={"batch_size": 2})
    with pytest.raises(ConfigError, match="different values"):
        fix_shapes(dynamic_copy, out, rows=ROWS, capacity=CAPACITY,
                   dims={"total_sequence_length": 32})
    result = fix_shapes(dynamic_copy, out, rows=ROWS, dims={"total_sequence_length": 32})
    assert (result.chunk_rows, result.decode_rows, result.capacity) == (ROWS, 1, 32)
    assert _shapes(result.chunk_model)["attention_mask"] == [1, 32]


def test_rerunning_on_its_own_output_is_refused_and_keeps_the_decode_graph(
        dynamic_copy, tmp_path, capsys):
    out = tmp_path / "out"
    fix_shapes(dynamic_copy, out, rows=ROWS, capacity=CAPACITY)
    before = _listing(out)
    assert "already fixed" in _refused(capsys, out / "chunk.onnx", out)
    assert _listing(out) == before and _shapes(out / "decode.onnx")["input_ids"] == [1, 1]
    again = fix_shapes(dynamic_copy, out, rows=2 * ROWS, capacity=CAPACITY)  # its own output
    assert again.chunk_rows == 2 * ROWS and _shapes(out / "decode.onnx")["input_ids"] == [1, 1]


def test_outputs_of_another_model_or_the_input_itself_are_never_written_over(
        dynamic_copy, tmp_path):
    twin = tmp_path / "twin"  # another model with the same graph bytes (a fine-tune, say)
    shutil.copytree(dynamic_copy.parent, twin)
    tuned = bytearray((twin / "model.onnx.data").read_bytes())
    tuned[-1] ^= 1  # the same names and sizes, other weights
    (twin / "model.onnx.data").write_bytes(bytes(tuned))
    other = tmp_path / "other"
    fix_shapes(twin / dynamic_copy.name, other, rows=ROWS, capacity=CAPACITY)
    before = _listing(other)
    with pytest.raises(OutputError, match="not fixed from"):
        fix_shapes(dynamic_copy, other, rows=ROWS, capacity=CAPACITY)
    assert _listing(other) == before
    (other / "chunk.onnx").unlink()
    (other / "decode.onnx").unlink()
    with pytest.raises(OutputError, match="belongs to another model"):
        fix_shapes(dynamic_copy, other, rows=ROWS, capacity=CAPACITY)
    assert _listing(other) == {"model.onnx.data": before["model.onnx.data"]}
    named_chunk = dynamic_copy.with_name("chunk.onnx")
    dynamic_copy.rename(named_chunk)
    source = named_chunk.read_bytes()
    with pytest.raises(OutputError, match="input model itself"):
        fix_shapes(named_chunk, named_chunk.parent, rows=ROWS, capacity=CAPACITY)
    assert named_chunk.read_bytes() == source
    assert not (named_chunk.parent / "decode.onnx").exists()


def test_unknown_dims_and_a_capacity_above_the_models_maximum_are_refused(
        dynamic_copy, tmp_path, capsys):
    out = tmp_path / "out"
    error = _refused(capsys, dynamic_copy, out, "--dim", "unknown=5")
    assert "unknown" in error and "past_sequence_length, sequence_length" in error
    with pytest.raises(ConfigError, match="maximum sequence length 2048"):
        fix_shapes(dynamic_copy, out, rows=ROWS, capacity=2049)
    with pytest.raises(ConfigError, match="maximum sequence length 2048"):
        fix_shapes(dynamic_copy, out, rows=ROWS,
                   dims={"past_sequence_length": 4096, "total_sequence_length": 4096})
    assert not out.exists()
    assert fix_shapes(dynamic_copy, out, rows=ROWS, capacity=2048).capacity == 2048


def test_the_graphs_name_their_source_by_content_not_path(dynamic_copy, tmp_path):
    elsewhere = tmp_path / "elsewhere" / "copy"
    shutil.copytree(dynamic_copy.parent, elsewhere)
    first = fix_shapes(dynamic_copy, tmp_path / "a", rows=ROWS, capacity=CAPACITY)
    second = fix_shapes(elsewhere / dynamic_copy.name, tmp_path / "b", rows=ROWS,
                        capacity=CAPACITY)
    for path in (first.chunk_model, first.decode_model):
        written = path.read_bytes()
        assert written == (tmp_path / "b" / path.name).read_bytes()
        assert str(tmp_path).encode() not in written
    assert second.chunk_rows == ROWS
    fix_shapes(elsewhere / dynamic_copy.name, tmp_path / "a", rows=ROWS, capacity=CAPACITY)


def test_a_window_sized_caches_present_is_fixed_at_the_capacity(dynamic_copy, tmp_path):
    model = onnx.load(dynamic_copy, load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":  # as the builder's sliding-window layers
            kept = [attribute for attribute in node.attribute
                    if attribute.name not in ("local_window_size", "sliding_window_cache")]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("local_window_size", 8),
                                   onnx.helper.make_attribute("sliding_window_cache", 1)])
    for value in model.graph.output:
        if value.name.startswith("present."):
            value.type.tensor_type.shape.dim[2].dim_param = "total_sliding_length"
    onnx.save(model, dynamic_copy)
    result = fix_shapes(dynamic_copy, tmp_path / "out", rows=ROWS, capacity=CAPACITY)
    assert result.free_outputs == [] and result.chunk_dims["total_sliding_length"] == CAPACITY
    for path in (result.chunk_model, result.decode_model):
        assert _shapes(path)["present.0.key"] == [1, 2, CAPACITY, 16]


def test_conv_state_is_refused_before_writing(reference_model, tmp_path, capsys):
    out = tmp_path / "out"
    error = _refused(capsys, reference_model("conv_hybrid"), out)
    assert "past.0.conv" in error and "dynamic model" in error and not out.exists()
