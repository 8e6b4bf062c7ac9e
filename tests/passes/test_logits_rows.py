"""LogitsRowsPass on the corpus of real exports: chosen rows' logits equal the full forward's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnx_chunk.errors import ConfigError, ModelStructureError
from onnx_chunk.graph import metadata
from onnx_chunk.passes.logits_rows import (
    LOGITS_ROWS,
    LastRowLogitsPass,
    LogitsRowsPass,
    find_lm_head,
)
from tests.exports.corpus import fixtures

ROWS = 7
# The builder's fp16 CPU export attends with MultiHeadAttention over a concatenated KV; it runs
# here too (the pass does not look at attention), so the whole corpus is covered.
CORPUS = fixtures()


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _feeds(session: ort.InferenceSession, folder: Path) -> dict[str, np.ndarray]:
    """A ROWS-token prompt with an empty past (a past at the sliding window where one is)."""
    genai = folder / "genai_config.json"
    decoder = json.loads(genai.read_text())["model"]["decoder"] if genai.is_file() else {}
    window = (decoder.get("sliding_window") or {}).get("window_size", 0)
    feeds: dict[str, np.ndarray] = {}
    for value in session.get_inputs():
        if value.name == "input_ids":
            feeds[value.name] = np.arange(3, 3 + ROWS, dtype=np.int64)[None]
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones((1, ROWS), np.int64)
        elif value.name == "position_ids":
            feeds[value.name] = np.arange(ROWS, dtype=np.int64)[None]
        elif value.name.startswith("past_key_values."):
            head = value.shape[3] if isinstance(value.shape[3], int) else decoder["head_size"]
            dtype = np.float16 if value.type == "tensor(float16)" else np.float32
            feeds[value.name] = np.zeros((1, value.shape[1], window, head), dtype)
        elif value.name.startswith("past."):
            feeds[value.name] = np.zeros((1, *value.shape[1:]), np.float32)
    return feeds


@pytest.mark.parametrize("fixture", CORPUS, ids=str)
def test_chosen_rows_logits_equal_the_full_forwards_rows(fixture, tmp_path):
    folder = fixture.copy_to(tmp_path / fixture.name)
    full_session = _session(folder / "model.onnx")
    feeds = _feeds(full_session, folder)
    full = full_session.run(["logits"], feeds)[0]
    model = ir.load(folder / "model.onnx")
    head, _ = find_lm_head(model.graph)
    assert LogitsRowsPass()(model).modified
    assert head.inputs[0].producer().op_type == "Gather"
    output = next(value for value in model.graph.outputs if value.name == "logits")
    assert str(output.shape[1]) == LOGITS_ROWS
    ir.save(model, folder / "rows.onnx")
    rows_session = _session(folder / "rows.onnx")
    tolerance = 2e-2 if fixture.precision == "fp16" else 1e-5
    for rows in ([ROWS - 1], [-1], [2, 6, 0], list(range(ROWS))):
        chosen = rows_session.run(["logits"], dict(feeds, logits_rows=np.array(rows, np.int64)))
        assert chosen[0].shape == (1, len(rows), full.shape[2])
        np.testing.assert_allclose(chosen[0], full[:, rows], rtol=tolerance, atol=tolerance)
    # Left out (or fed empty), the input selects every row: the unconverted graph's logits.
    for left_out in (feeds, dict(feeds, logits_rows=np.zeros(0, np.int64))):
        every = rows_session.run(["logits"], left_out)[0]
        assert every.shape == full.shape
        np.testing.assert_allclose(every, full, rtol=tolerance, atol=tolerance)
    assert metadata.read_logits_rows(model) == LOGITS_ROWS


@pytest.mark.parametrize("fixture", CORPUS[:3], ids=str)
def test_off_restores_the_original_graph(fixture, tmp_path):
    original = ir.load(fixture.folder / "model.onnx")
    model = ir.load(fixture.folder / "model.onnx")
    assert LogitsRowsPass("auto")(model).modified
    assert LogitsRowsPass("off")(model).modified
    assert not LogitsRowsPass("off")(model).modified
    assert metadata.read_logits_rows(model) is None
    assert [value.name for value in model.graph.inputs] == \
        [value.name for value in original.graph.inputs]
    assert sorted(model.graph.initializers) == sorted(original.graph.initializers)
    assert [node.op_type for node in model.graph] == [node.op_type for node in original.graph]
    shapes = [[str(dim) for dim in value.shape] for value in model.graph.outputs]
    assert shapes == [[str(dim) for dim in value.shape] for value in original.graph.outputs]


@pytest.mark.parametrize("fixture", CORPUS, ids=str)
def test_the_last_row_pass_gives_the_full_forwards_last_row(fixture, tmp_path):
    folder = fixture.copy_to(tmp_path / fixture.name)
    full_session = _session(folder / "model.onnx")
    feeds = _feeds(full_session, folder)
    full = full_session.run(["logits"], feeds)[0]
    model = ir.load(folder / "model.onnx")
    assert LastRowLogitsPass()(model).modified
    assert not LastRowLogitsPass()(model).modified  # already one row: left as it is
    ir.save(model, folder / "last.onnx")
    last = _session(folder / "last.onnx").run(["logits"], feeds)[0]
    tolerance = 2e-2 if fixture.precision == "fp16" else 1e-5
    assert last.shape == (1, 1, full.shape[2])
    np.testing.assert_allclose(last, full[:, -1:], rtol=tolerance, atol=tolerance)


def test_todays_runtime_serves_a_converted_last_row_decoder_with_the_same_tokens(tmp_path):
    from onnx_chunk.cli import main
    from onnx_chunk.graph.model_io import load_model, save_model
    from onnx_chunk.runtime import load

    source = next(fixture for fixture in CORPUS if fixture.name == "genai-llama-int4")
    converted = tmp_path / "conv" / "model.onnx"
    assert main(["convert", str(source.folder), "-o", str(converted), "--chunk-size", "32",
                 "--logits-rows", "off"]) == 0
    prompt = [(7 * index + 3) % 384 for index in range(100)]
    with load(converted, provider="cpu") as runtime:
        expected = runtime.open_sequence().generate(prompt, 8)
    model = load_model(converted)
    assert LastRowLogitsPass()(model).modified
    save_model(model, converted)
    with load(converted, provider="cpu") as runtime:
        assert runtime.debug.ports.last_row_logits
        sequence = runtime.open_sequence()
        assert sequence.generate(prompt, 8) == expected
        with pytest.raises(ModelStructureError, match="last row's logits only"):
            runtime.open_sequence().prefill(prompt, all_logits=True)


def test_a_converted_graph_is_left_as_it_is():
    model = ir.load(CORPUS[0].folder / "model.onnx")
    assert LogitsRowsPass()(model).modified
    nodes = len(model.graph)
    assert not LogitsRowsPass()(model).modified
    assert len(model.graph) == nodes


def _head_graph(between: list[onnx.NodeProto], query: str | int = "sequence_length",
                output: str = "logits") -> ir.Model:
    weight = onnx.numpy_helper.from_array(np.zeros((4, 8), np.float32), "lm_head.weight")
    scale = onnx.numpy_helper.from_array(np.ones((1, 1, 8), np.float32), "row_scale")
    nodes = [helper.make_node("MatMul", ["hidden", "lm_head.weight"],
                              ["head" if between else output], name="/lm_head/MatMul"), *between]
    graph = helper.make_graph(
        nodes, "head",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", query]),
         helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch_size", query, 4])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch_size", query, 8])],
        [weight, scale])
    return ir.from_proto(helper.make_model(graph))


@pytest.mark.parametrize("pass_, error", [(LogitsRowsPass, ConfigError),
                                          (LastRowLogitsPass, ModelStructureError)])
def test_a_node_that_is_not_row_wise_before_the_logits_is_refused(pass_, error):
    softmax = helper.make_node("Softmax", ["head"], ["logits"], axis=1)
    with pytest.raises(error, match="Softmax .* not row-wise") as refused:
        pass_()(_head_graph([softmax]))
    assert isinstance(refused.value, ir.passes.PreconditionError)  # requires() refused it
    # A constant with a row axis of its own cannot be gathered along: refused too.
    scaled = helper.make_node("Mul", ["head", "row_scale"], ["logits"])
    with pytest.raises(ConfigError, match="--logits-rows on: .*Mul .* not row-wise"):
        LogitsRowsPass()(_head_graph([scaled]))


def test_logits_without_a_named_query_axis_or_no_logits_are_refused():
    with pytest.raises(ConfigError, match="axis 1 of the logits must be the query") as axis:
        LogitsRowsPass()(_head_graph([], query=5))
    with pytest.raises(ConfigError, match="no 'logits' output") as output:
        LogitsRowsPass()(_head_graph([], output="scores"))
    with pytest.raises(ModelStructureError, match="no 'logits' output") as last_row:
        LastRowLogitsPass()(_head_graph([], output="scores"))
    assert all(isinstance(refused.value, ir.passes.PreconditionError)
               for refused in (axis, output, last_row))


def test_auto_leaves_a_graph_whose_rows_cannot_be_chosen_as_it_is():
    model = _head_graph([helper.make_node("Softmax", ["head"], ["logits"], axis=1)])
    nodes = len(model.graph)
    assert not LogitsRowsPass("auto")(model).modified
    assert len(model.graph) == nodes and metadata.read_logits_rows(model) is None
    with pytest.raises(ConfigError, match="must be one of auto, on, off"):
        LogitsRowsPass("yes")


def test_convert_on_refuses_in_one_line_and_auto_writes_no_input(make_decoder, tmp_path,
                                                                 capsys):
    from onnx_chunk.cli import main
    from onnx_chunk.graph.model_io import save_model

    source = tmp_path / "in" / "model.onnx"
    # A query axis fixed at 5 rows: the logits rows cannot be chosen (rule 2).
    save_model(make_decoder(query_dim=5), source)
    code = main(["convert", str(source), "-o", str(tmp_path / "on"), "--logits-rows", "on"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: --logits-rows on:")
    assert not (tmp_path / "on").exists()
    assert main(["convert", str(source), "-o", str(tmp_path / "auto")]) == 0
    written = onnx.load(str(tmp_path / "auto" / source.name), load_external_data=False)
    assert LOGITS_ROWS not in [value.name for value in written.graph.input]


def test_convert_wires_it_by_default_and_inspect_names_it(tmp_path, capsys):
    from onnx_chunk.cli import main

    source = next(fixture for fixture in CORPUS if fixture.name == "genai-llama-int4")
    for mode, expected in (("auto", LOGITS_ROWS), ("off", None)):
        args = [] if mode == "auto" else ["--logits-rows", mode]
        assert main(["convert", str(source.folder), "-o", str(tmp_path / mode), "-q", *args]) == 0
        capsys.readouterr()
        assert main(["inspect", str(tmp_path / mode), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["logits_rows"] == expected
