"""The whole-prompt reference: a last-row copy of the graph, and runs that keep a few rows."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from onnx_chunk import load
from onnx_chunk.ort_schemas import register_runtime_schemas
from onnx_chunk.validate.reference import attention_noise_graph, last_row_graph
from onnx_chunk.validate.runs import RunSettings, boundaries, reference_run
from tests.exports.corpus import ROOT

from .conftest import CHUNK


@pytest.mark.parametrize("specialize", [False, True])
def test_the_copy_applies_the_lm_head_to_the_last_row_and_writes_nothing(tmp_path, specialize):
    folder = tmp_path / "export"
    shutil.copytree(ROOT / "genai-llama-int4", folder)
    before = {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}
    graph = last_row_graph(folder / "model.onnx")
    assert isinstance(graph, bytes)
    logits = next(value for value in onnx.load_from_string(graph).graph.output
                  if value.name == "logits")
    assert logits.type.tensor_type.shape.dim[1].dim_value == 1
    ids = np.arange(3, 40)
    with load(folder, provider="cpu", capacity=64, chunk_size=64, graph=graph,
              specialize=specialize) as runtime:
        assert runtime.debug.ports.last_row_logits
        last = runtime.open_sequence().prefill(ids)
        # While the copy runs, the model is still one ONNX's checker accepts (hard links of
        # its weights would fail it).
        register_runtime_schemas()
        onnx.checker.check_model(str(folder / "model.onnx"))
    with load(folder, provider="cpu", capacity=64, chunk_size=64) as runtime:
        every = runtime.open_sequence().prefill(ids, all_logits=True)
    assert last.shape == every[-1].shape
    assert np.abs(last - every[-1]).max() < 1e-3
    assert (folder / "model.onnx.data").stat().st_nlink == 1
    assert {path.name: path.stat().st_mtime_ns for path in folder.iterdir()} == before


def test_a_decoder_with_last_row_logits_is_used_as_it_is(reference_model):
    assert last_row_graph(reference_model("last_token_logits")) is None


def test_a_reference_run_keeps_the_boundary_rows_not_the_prompt(reference_model):
    settings = RunSettings(provider="cpu", capacity=64, chunk_size=CHUNK, lengths=(19,),
                           new_tokens=3, seed=0, atol=1e-5)
    with load(reference_model("base"), provider="cpu", capacity=64, chunk_size=64) as runtime:
        run = reference_run(runtime, 19, settings)
        with runtime.open_sequence() as sequence:
            from onnx_chunk.validate.prompts import seeded_prompt

            every = sequence.prefill(seeded_prompt(runtime.stats.vocab_size, 19, 0),
                                     all_logits=True)
    assert sorted(run.rows) == boundaries(19, CHUNK) == [7, 15, 18]
    assert all(row.ndim == 1 for row in run.rows.values())
    assert len(run.decode) == 2 and len(run.tokens) == len(run.margins) == 3
    # Each boundary row is the whole forward of its prefix: the same numbers as that row of
    # the whole prompt's forward (float32 on CPU: bit for bit).
    for row, logits in run.rows.items():
        np.testing.assert_array_equal(logits, every[row])


@pytest.mark.parametrize(("name", "factor"), [("genai-llama-fp32", 1.0 + 2.0**-23),
                                              ("genai-llama-fp16", 1.0 + 2.0**-10)])
def test_the_noise_copy_moves_every_attention_output_one_ulp_up(name, factor):
    """Each attention node's output is multiplied by 1 + one ulp of the type the model
    computes in, under the output's own name; the LM head reads the last row."""
    model = ROOT / name / "model.onnx"
    graph, count = attention_noise_graph(model)
    assert graph is not None
    proto = onnx.load_from_string(graph)
    kinds = {"GroupQueryAttention", "MultiHeadAttention"}  # the fp16 export has the latter
    attention = [node for node in proto.graph.node if node.op_type in kinds]
    original = onnx.load(str(model), load_external_data=False)
    assert count == len(attention) == sum(node.op_type in kinds
                                          for node in original.graph.node) > 0
    constants = {tensor.name: tensor for tensor in proto.graph.initializer}
    consumers = {name: node for node in proto.graph.node for name in node.input}
    for node in attention:
        mul = consumers[node.output[0]]
        assert mul.op_type == "Mul"
        value = onnx.numpy_helper.to_array(constants[mul.input[1]])
        assert value.dtype == (np.float16 if name.endswith("fp16") else np.float32)
        assert float(value) == factor
        assert mul.output[0] == next(original_node.output[0] for original_node in
                                     original.graph.node if original_node.name == node.name)
    logits = next(value for value in proto.graph.output if value.name == "logits")
    assert logits.type.tensor_type.shape.dim[1].dim_value == 1
