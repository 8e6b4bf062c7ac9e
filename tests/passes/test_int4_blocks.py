"""Int4BlocksPass and `convert --int4-block-size`: on every INT4 export of the corpus the
weights ONNX Runtime computes with are read exactly, re-blocked within the requantization
error, the converted folder generates close to the original, and every refusal is one line."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnx_chunk.cli import main
from onnx_chunk.errors import ConfigError, ModelStructureError
from onnx_chunk.graph import metadata
from onnx_chunk.graph.model_io import load_model, save_model
from onnx_chunk.passes import Int4BlocksPass, convert_model
from onnx_chunk.passes.int4_blocks import dequantize_int4, find_int4_matmuls, quantize_int4
from tests.cli_output import one_error_line
from tests.exports.converted import greedy_tokens_both, logits_and_tokens
from tests.exports.corpus import GENAI, fixtures

INT4 = [fixture for fixture in fixtures(GENAI) if fixture.precision == "int4"]
FP32_LLAMA = next(fixture for fixture in fixtures(GENAI) if fixture.name == "genai-llama-fp32")
# The corpus's K is 64 or 96: 64 divides 96 into a whole and a partial block, 128 and 256 are
# one partial block (ONNX Runtime pads K up to the block).
BLOCKS = (64, 128, 256)
# The largest move of the re-blocked folder's prompt logits from the original's, as a fraction
# of their spread (largest minus smallest). Measured over the corpus's random-weight models
# (40-token prompt, every row): 0.12-0.25 at blocks 64, 128 and 256 (printed by the test); with
# the two nibbles of a byte read in the wrong order, 0.78-0.87.
LOGITS_DRIFT = 0.35


def _weights(model: ir.Model) -> dict[str, np.ndarray]:
    """Each 4-bit MatMulNBits node's dequantized [N, K] weights, by node name."""
    matmuls, _ = find_int4_matmuls(model.graph)
    return {matmul.node.name: dequantize_int4(
        matmul.packed.const_value.numpy(), matmul.scales.const_value.numpy(),
        None if matmul.zero_points is None else matmul.zero_points.const_value.numpy(),
        matmul.k, matmul.block_size) for matmul in matmuls}


def _other_bits(model: ir.Model) -> dict[str, tuple[int, bytes]]:
    """Each MatMulNBits node of another bit width than 4: (bits, its packed weights' bytes)."""
    return {node.name: (node.attributes["bits"].as_int(), node.inputs[1].const_value.tobytes())
            for node in model.graph if node.op_type == "MatMulNBits"
            and node.attributes["bits"].as_int() != 4}


def _steps(model: ir.Model) -> dict[str, np.ndarray]:
    """Each 4-bit node's quantization step (its block's scale) per weight, [N, K]."""
    matmuls, _ = find_int4_matmuls(model.graph)
    steps = {}
    for matmul in matmuls:
        scales = matmul.scales.const_value.numpy().astype(np.float64).reshape(matmul.n, -1)
        steps[matmul.node.name] = np.repeat(scales, matmul.block_size, axis=1)[:, :matmul.k]
    return steps


def _one_node_model(matmul) -> bytes:
    """A model of the node alone, accuracy_level 0 (no int8 rounding of its input)."""
    node = matmul.node
    names = ["A"] + [value.name for value in node.inputs[1:4] if value is not None]
    inits = [onnx.numpy_helper.from_array(value.const_value.numpy(), value.name)
             for value in node.inputs[1:4] if value is not None]
    attributes = {name: attr.as_int() for name, attr in node.attributes.items()}
    attributes["accuracy_level"] = 0
    element = onnx.helper.np_dtype_to_tensor_dtype(matmul.scales.const_value.numpy().dtype)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMulNBits", names, ["Y"], domain="com.microsoft",
                               **attributes)], "one",
        [onnx.helper.make_tensor_value_info("A", element, [None, matmul.k])],
        [onnx.helper.make_tensor_value_info("Y", element, [None, matmul.n])],
        inits)
    return onnx.helper.make_model(graph, opset_imports=[
        onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid("com.microsoft", 1)]
    ).SerializeToString()


def _ort_weights(matmul) -> np.ndarray:
    """The [N, K] weights ONNX Runtime's kernel multiplies by: the node applied to I_K."""
    session = ort.InferenceSession(_one_node_model(matmul), providers=["CPUExecutionProvider"])
    identity = np.eye(matmul.k, dtype=matmul.scales.const_value.numpy().dtype)
    return session.run(None, {"A": identity})[0].T


@pytest.mark.parametrize("fixture", INT4, ids=str)
def test_the_dequantized_weights_are_what_onnxruntime_computes_with(fixture):
    original = load_model(fixture.folder / "model.onnx")
    reblocked = convert_model(load_model(fixture.folder / "model.onnx"), chunk_size=64,
                              int4_block_size=128).model
    for model in (original, reblocked):
        matmuls, _ = find_int4_matmuls(model.graph)
        assert matmuls
        weights = _weights(model)
        for matmul in matmuls:
            np.testing.assert_allclose(_ort_weights(matmul), weights[matmul.node.name],
                                       rtol=0, atol=1e-6)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("fixture", INT4, ids=str)
def test_every_int4_node_is_reblocked_within_the_requantization_error(fixture, block, capsys):
    original = load_model(fixture.folder / "model.onnx")
    before = _weights(original)
    result = convert_model(load_model(fixture.folder / "model.onnx"), chunk_size=64,
                           int4_block_size=block)
    model = result.model
    assert result.modified
    matmuls, others = find_int4_matmuls(model.graph)
    # MatMulNBits of other bit widths (genai-llama-int4h8's 8-bit lm_head) are left as they are
    exported_others = find_int4_matmuls(original.graph)[1]
    assert {matmul.block_size for matmul in matmuls} == {block} and others == exported_others
    assert _other_bits(model) == _other_bits(original)
    for matmul in matmuls:
        attributes = matmul.node.attributes
        assert attributes["bits"].as_int() == 4 and attributes["accuracy_level"].as_int() == 4
        assert matmul.packed.const_value.shape == (matmul.n, -(-matmul.k // block), block // 2)
    after, steps = _weights(model), _steps(model)
    worst = 0.0
    for name, weights in before.items():
        error = np.abs(after[name].astype(np.float64) - weights)
        step = np.abs(steps[name])
        # Symmetric 4-bit codes run from -8 to 7 steps (the block's largest magnitude is -8):
        # a weight rounds to the nearest step, half a step at most, except above 7.5 steps,
        # where it is clipped to 7 (under a step: no weight exceeds 8 steps).
        codes = np.divide(weights, steps[name], out=np.zeros_like(error),
                          where=steps[name] != 0)
        inside = codes <= 7.5
        assert np.all(error[inside] <= 0.5 * step[inside] * (1 + 1e-5) + 1e-7), name
        assert np.all(error <= step * (1 + 1e-5) + 1e-7), name
        ratio = np.divide(error, step, out=np.zeros_like(error), where=step != 0)
        worst = max(worst, float(ratio[inside].max()))
    declared = metadata.read_int4_blocks(model)
    assert declared == metadata.Int4BlocksDeclaration(
        block_size=block, nodes=len(matmuls), reblocked_nodes=len(matmuls),
        source_block_sizes=[32], other_bits_nodes=exported_others)
    assert not Int4BlocksPass(block)(model).modified
    with capsys.disabled():
        print(f"\n{fixture} block {block}: largest rounding error {worst:.4f} of a step")


def test_the_tied_embedding_keeps_its_weights_and_block(tmp_path):
    fixture = next(fixture for fixture in INT4 if fixture.model_type == "lfm2")
    model = convert_model(load_model(fixture.folder / "model.onnx"), chunk_size=64,
                          int4_block_size=128).model
    embedding = next(node for node in model.graph if node.op_type == "GatherBlockQuantized")
    assert embedding.attributes["block_size"].as_int() == 32
    head = next(node for node in model.graph
                if node.op_type == "MatMulNBits" and node.name.startswith("/lm_head"))
    assert [value.name for value in head.inputs[1:3]] == [
        "lm_head.MatMul.weight_Q4.block128", "lm_head.MatMul.weight_scales.block128"]
    original = onnx.load(str(fixture.folder / "model.onnx"))
    save_model(model, tmp_path / "model.onnx")
    written = onnx.load(str(tmp_path / "model.onnx"))
    for name in ("lm_head.MatMul.weight_Q4", "lm_head.MatMul.weight_scales"):
        source = next(tensor for tensor in original.graph.initializer if tensor.name == name)
        kept = next(tensor for tensor in written.graph.initializer if tensor.name == name)
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(kept),
                                      onnx.numpy_helper.to_array(source))


@pytest.mark.parametrize("block", (128, 256))
@pytest.mark.parametrize("fixture", INT4, ids=str)
def test_the_reblocked_folder_generates_close_to_the_original(fixture, block, tmp_path, capsys):
    out = tmp_path / "reblocked"
    assert main(["convert", str(fixture.folder), "-o", str(out), "--int4-block-size",
                 str(block), "-q"]) == 0
    capsys.readouterr()
    original, original_tokens = logits_and_tokens(fixture.folder)
    reblocked, tokens = logits_and_tokens(out)
    assert len(tokens) == 8
    spread = float(original.max() - original.min())
    drift = float(np.abs(reblocked - original).max()) / spread
    assert drift < LOGITS_DRIFT
    agreement = sum(a == b for a, b in zip(tokens, original_tokens)) / len(tokens)
    with capsys.disabled():
        print(f"\n{fixture} block {block}: prompt logits drift {drift:.4f} of their spread, "
              f"greedy agreement {agreement:.2f}")


def test_the_reblocked_folder_runs_in_genai_with_onnx_chunks_tokens(tmp_path, peer_python,
                                                                   capsys):
    """The converted folder (native chunks off: genai 0.18 brings an ORT without them) keeps
    genai's config; genai's og.Generator reads the re-blocked weights as onnx-chunk does."""
    fixture = next(fixture for fixture in INT4 if fixture.model_type == "lfm2")
    out = tmp_path / "reblocked"
    assert main(["convert", str(fixture.folder), "-o", str(out), "--int4-block-size", "128",
                 "--native-chunks", "off", "-q"]) == 0
    capsys.readouterr()
    ours, genai = greedy_tokens_both(out, peer_python)
    assert genai == ours


def test_the_block_the_model_has_changes_no_weight(tmp_path, capsys):
    fixture = INT4[0]
    out = tmp_path / "same"
    assert main(["convert", str(fixture.folder), "-o", str(out), "--int4-block-size", "32",
                 "-q"]) == 0
    original = onnx.load(str(fixture.folder / "model.onnx"))
    written = onnx.load(str(out / "model.onnx"))
    source = {tensor.name: onnx.numpy_helper.to_array(tensor).tobytes()
              for tensor in original.graph.initializer}
    kept = {tensor.name: onnx.numpy_helper.to_array(tensor).tobytes()
            for tensor in written.graph.initializer if tensor.name in source}
    assert kept == source
    declared = metadata.read_int4_blocks(written)
    assert declared is not None and (declared.block_size, declared.reblocked_nodes) == (32, 0)


def _synthetic(weights: np.ndarray, block: int, symmetric: bool, zero_points_rank: int = 2,
               g_idx: bool = False) -> ir.Model:
    """One MatMulNBits over `weights` [N, K] quantized by ONNX Runtime at `block`."""
    n, k = weights.shape
    packed, scales, zero_points = quantize_int4(weights, block, symmetric)
    inputs: list[ir.Value | None] = [ir.Value(name="A", type=ir.TensorType(ir.DataType.FLOAT),
                                              shape=ir.Shape(["rows", k]))]
    graph = ir.Graph(inputs=[inputs[0]], outputs=[], nodes=[], opset_imports={
        "": 21, "com.microsoft": 1}, name="g")
    arrays = {"B": packed, "scales": scales}
    if zero_points is not None:
        arrays["zero_points"] = (zero_points if zero_points_rank == 2
                                 else zero_points.reshape(-1))
    if g_idx:
        arrays["g_idx"] = np.zeros(k, dtype=np.int32)
    for name, array in arrays.items():
        value = ir.Value(name=name, shape=ir.Shape(array.shape),
                         type=ir.TensorType(ir.tensor(array).dtype),
                         const_value=ir.tensor(array, name=name))
        graph.register_initializer(value)
        inputs.append(value)
    if g_idx and zero_points is None:
        inputs.insert(3, None)
    node = ir.node("MatMulNBits", inputs, {"K": k, "N": n, "bits": 4, "block_size": block,
                                          "accuracy_level": 4},
                   domain="com.microsoft", name="matmul")
    graph.append(node)
    graph.outputs.append(node.outputs[0])
    return ir.Model(graph, ir_version=10)


@pytest.mark.parametrize("dtype", (np.float32, np.float16))
@pytest.mark.parametrize("zero_points_rank", (1, 2))
def test_asymmetric_weights_stay_asymmetric_within_half_a_step(dtype, zero_points_rank):
    rng = np.random.default_rng(5)
    weights = (rng.standard_normal((24, 160)) + 0.3).astype(dtype)
    model = _synthetic(weights, 32, symmetric=False, zero_points_rank=zero_points_rank)
    before = _weights(model)["matmul"].astype(np.float64)
    assert Int4BlocksPass(128)(model).modified
    (matmul,), _ = find_int4_matmuls(model.graph)
    assert matmul.block_size == 128 and matmul.zero_points is not None
    assert matmul.zero_points.const_value.shape == ((24, 1) if zero_points_rank == 2 else (24,))
    assert matmul.scales.const_value.dtype == ir.tensor(weights).dtype
    error = np.abs(_weights(model)["matmul"].astype(np.float64) - before)
    tolerance = 1e-3 if dtype == np.float16 else 1e-6
    assert np.all(error <= 0.5 * np.abs(_steps(model)["matmul"]) * (1 + tolerance) + tolerance)
    np.testing.assert_allclose(_ort_weights(matmul), _weights(model)["matmul"], atol=tolerance)


def test_nodes_the_pass_cannot_read_and_block_sizes_outside_the_list_are_refused():
    rng = np.random.default_rng(1)
    weights = rng.standard_normal((8, 64)).astype(np.float32)
    with pytest.raises(ModelStructureError, match="MatMulNBits 'matmul' reads a g_idx") as g_idx:
        Int4BlocksPass(128)(_synthetic(weights, 32, symmetric=True, g_idx=True))
    with pytest.raises(ConfigError, match="one of 32, 64, 128, 256, got 48"):
        Int4BlocksPass(48)
    with pytest.raises(ConfigError, match="--int4-block-size applies to 4-bit") as no_int4:
        Int4BlocksPass(128)(load_model(FP32_LLAMA.folder / "model.onnx"))
    # Both are the pass's preconditions, refused by requires() before it changes anything.
    assert all(isinstance(refused.value, ir.passes.PreconditionError)
               for refused in (g_idx, no_int4))
    with pytest.raises(ConfigError, match="--int4-block-size applies to 4-bit"):
        convert_model(load_model(FP32_LLAMA.folder / "model.onnx"), int4_block_size=128)


def test_cli_refusals_in_one_line(tmp_path, capsys):
    assert main(["convert", str(FP32_LLAMA.folder), "-o", str(tmp_path / "a"),
                 "--int4-block-size", "128"]) == 2
    one_error_line(capsys, "--int4-block-size", "MatMulNBits")
    assert main(["convert", str(INT4[0].folder), "-o", str(tmp_path / "b"),
                 "--int4-block-size", "48"]) == 2
    one_error_line(capsys, "--int4-block-size", "48")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
