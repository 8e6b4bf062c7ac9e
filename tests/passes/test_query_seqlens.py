"""The query_seqlens pass: GroupQueryAttention's query_seqlens wired where ONNX Runtime has it."""

import onnx
import onnx_ir as ir
import pytest

from onnx_chunk.cli import main
from onnx_chunk.errors import ConfigError
from onnx_chunk.graph import metadata
from onnx_chunk.graph.query_seqlens import QUERY_SEQLENS, query_seqlens_index
from onnx_chunk.passes import convert_model
from onnx_chunk.passes import query_seqlens as pass_module
from onnx_chunk.passes.query_seqlens import QuerySeqlensPass
from onnx_chunk.passes.value_tracing import gqa_nodes
from tests.exports.corpus import fixtures
from tests.passes.export_graphs import load_export


@pytest.fixture
def lacking(monkeypatch):
    """Act as an ONNX Runtime whose GroupQueryAttention has no query_seqlens (1.31)."""
    monkeypatch.setattr(pass_module, "query_seqlens_index", lambda: None)


def _wired(model) -> list[str | None]:
    index = query_seqlens_index()
    return [None if len(node.inputs) <= index or node.inputs[index] is None
            else node.inputs[index].name for node in gqa_nodes(model.graph)]


def test_the_installed_onnx_runtime_has_the_input():
    """The feature is read from ONNX Runtime's own schema: 1.32's GQA takes it as input 16."""
    assert query_seqlens_index() == 16


def test_every_gqa_is_wired_once_and_a_second_run_changes_nothing():
    model = load_export("genai-llama-fp32")
    assert QuerySeqlensPass("auto")(model).modified
    assert _wired(model) == [f"{QUERY_SEQLENS}_or_all_rows"] * 2
    value = next(value for value in model.graph.inputs if value.name == QUERY_SEQLENS)
    assert value.dtype.name == "INT32"
    # Rule 5: also an initializer, empty by default, so callers that do not feed it still run.
    assert model.graph.initializers[QUERY_SEQLENS] is value and value.const_value.size == 0
    assert metadata.read_query_seqlens(model) == QUERY_SEQLENS
    assert not QuerySeqlensPass("auto")(model).modified
    assert not QuerySeqlensPass("on")(model).modified


def test_off_takes_the_wiring_back_out():
    original = load_export("genai-llama-fp32")
    names = [value.name for value in original.graph.inputs]
    model = load_export("genai-llama-fp32")
    QuerySeqlensPass("on")(model)
    assert QuerySeqlensPass("off")(model).modified
    assert [value.name for value in model.graph.inputs] == names
    assert _wired(model) == [None, None]
    assert len(list(model.graph)) == len(list(original.graph))
    assert QUERY_SEQLENS not in model.graph.initializers
    assert metadata.read_query_seqlens(model) is None
    assert not QuerySeqlensPass("off")(model).modified


def test_an_onnx_runtime_without_the_input_wires_nothing_and_refuses_on(lacking):
    model = load_export("genai-llama-fp32")
    assert not QuerySeqlensPass("auto")(model).modified
    assert QUERY_SEQLENS not in [value.name for value in model.graph.inputs]
    with pytest.raises(ConfigError, match="has no GroupQueryAttention input 'query_seqlens'") \
            as refused:
        QuerySeqlensPass("on")(model)
    assert isinstance(refused.value, ir.passes.PreconditionError)  # requires() refused it


def test_a_gqa_without_past_is_not_wired():
    """The operator needs past_key and past_value with query_seqlens."""
    model = load_export("genai-llama-fp32")
    node = gqa_nodes(model.graph)[1]
    node.replace_input_with(3, None)
    node.replace_input_with(4, None)
    assert not QuerySeqlensPass("auto")(model).modified
    assert metadata.read_query_seqlens(model) is None
    with pytest.raises(ConfigError, match="no past_key/past_value") as refused:
        QuerySeqlensPass("on")(model)
    assert isinstance(refused.value, ir.passes.PreconditionError)  # requires() refused it


def test_a_bad_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="auto, on, off"):
        QuerySeqlensPass("yes")


def test_native_chunks_make_a_sliding_window_export_eligible_for_padding():
    """Padded rows never enter the cache natively, so a window-sized cache no longer voids
    padding; recurrent state still does (lfm2), and says why."""
    native = metadata.read_plan(convert_model(load_export("genai-gemma2-fp32")).model)
    repeat = metadata.read_plan(convert_model(load_export("genai-gemma2-fp32"),
                                              native_chunks="off").model)
    assert native.query_seqlens == QUERY_SEQLENS and native.padding.eligible
    assert not repeat.padding.eligible and "window-sized" in repeat.padding.reasons[0]
    hybrid = metadata.read_plan(convert_model(load_export("genai-lfm2-fp32")).model)
    assert hybrid.query_seqlens == QUERY_SEQLENS and not hybrid.padding.eligible
    assert all("recurrent state" in reason for reason in hybrid.padding.reasons)


def test_the_plan_and_its_json_name_the_input():
    plan = metadata.read_plan(convert_model(load_export("genai-llama-fp32")).model)
    assert plan.to_json()["query_seqlens"] == QUERY_SEQLENS
    assert "query_seqlens" not in plan.per_token_ports and plan.padding.eligible


def test_convert_cli_refuses_on_in_one_line(tmp_path, capsys, lacking):
    source = fixtures()[0].folder
    code = main(["convert", str(source), "-o", str(tmp_path / "out"), "--native-chunks", "on"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error:")
    assert "--native-chunks on" in err and not (tmp_path / "out").exists()


def test_convert_cli_writes_the_input_by_default(tmp_path):
    source = fixtures()[0].folder
    assert main(["convert", str(source), "-o", str(tmp_path / "out")]) == 0
    graph = onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph
    assert QUERY_SEQLENS in [value.name for value in graph.input]


def test_a_caller_that_does_not_feed_the_input_gets_the_unpadded_forward(tmp_path):
    """Rule 5: onnxruntime-genai and plain ONNX Runtime loops leave query_seqlens out; the
    wired model then gives the unwired model's logits and KV (every row real), and fed the
    real row count it gives the same."""
    import json

    import numpy as np
    import onnx_ir as ir
    import onnxruntime as ort

    original = load_export("genai-llama-fp32")
    wired = load_export("genai-llama-fp32")
    QuerySeqlensPass("on")(wired)
    paths = []
    for name, model in (("plain", original), ("wired", wired)):
        path = tmp_path / f"{name}.onnx"
        ir.save(model, path, external_data=f"{name}.onnx.data")
        paths.append(path)
    plain, native = (ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
                     for path in paths)
    rows = 5
    feeds = {"input_ids": np.arange(1, rows + 1, dtype=np.int64)[None],
             "attention_mask": np.ones((1, rows), dtype=np.int64)}
    folder = next(f.folder for f in fixtures() if f.name == "genai-llama-fp32")
    head = json.loads((folder / "genai_config.json")
                      .read_text())["model"]["decoder"]["head_size"]
    for value in plain.get_inputs():
        if value.name.startswith("past_key_values."):
            feeds[value.name] = np.zeros((1, value.shape[1], 0, head), np.float32)
    expected = plain.run(None, feeds)
    left_out = native.run(None, feeds)
    fed = native.run(None, {**feeds, QUERY_SEQLENS: np.array([rows], dtype=np.int32)})
    for want, got, also in zip(expected, left_out, fed):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(also, want)
