"""Every command and the API on every export of the corpus, as a user runs them.

Builder exports with GroupQueryAttention: inspect, convert, validate (structure.checker
included), generate and the API on the file and on the folder, fix-shapes and its output, the
model's EOS as the default stop, the converted folder in onnxruntime-genai, and CUDA's
device-memory path run on CPU (the same tokens as the host path). The builder's
fp16 CPU export (MultiHeadAttention over a concatenated KV) is refused with one clear line.
"""

from __future__ import annotations

import json

import onnx
import onnxruntime
import pytest

from onnx_chunk.cli import main
from onnx_chunk.runtime import load
from onnx_chunk.static import load_static
from scripts._bench import environment
from scripts._bench.child import run_child
from tests.cli_output import validate_passes
from tests.cuda.test_device_inputs import DEVICE
from tests.exports.corpus import GENAI, builder_gqa_fixtures, fixtures

CHUNK = 128
NEW_TOKENS = 6


def _cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _prompt(runtime, length: int = 300) -> list[int]:
    return [(7 * index + 3) % runtime.stats.vocab_size for index in range(length)]


@pytest.fixture(params=builder_gqa_fixtures(), ids=str)
def export(request):
    return request.param


@pytest.fixture
def converted(export, tmp_path, capsys):
    code, _, err = _cli(capsys, "convert", export.folder, "-o", tmp_path / "conv",
                        "--chunk-size", CHUNK)
    assert code == 0, err
    return tmp_path / "conv"


def test_inspect_reads_the_plan_from_the_file_and_the_folder(export, capsys):
    outputs = []
    for target in (export.folder, export.folder / "model.onnx"):
        code, out, err = _cli(capsys, "inspect", target, "--json")
        assert code == 0, err
        outputs.append(json.loads(out))
    assert outputs[0] == outputs[1]
    plan = outputs[0]["plan"] if "plan" in outputs[0] else outputs[0]
    bindings = plan["kv_bindings"]
    assert len(bindings) == 2 * plan["gqa_nodes"] > 0
    head_dim = export.features["head_dim"]
    assert {binding["head_size"] for binding in bindings} == {head_dim}
    windowed = {binding["window"] for binding in bindings} - {None}
    assert windowed == ({export.features["sliding_window"]}
                        if export.features.get("sliding_window") else set())


@pytest.fixture
def converted_for_genai(export, tmp_path, capsys):
    """Converted without native chunks, so that onnxruntime-genai 0.18 loads it over any
    onnxruntime: 1.31's GroupQueryAttention has no query_seqlens ("has input size 17 not in
    range [min=7, max=16]"); 1.32, the peer venv's, has it."""
    code, _, err = _cli(capsys, "convert", export.folder, "-o", tmp_path / "conv",
                        "--chunk-size", CHUNK, "--native-chunks", "off")
    assert code == 0, err
    return tmp_path / "conv"


def test_the_converted_folder_runs_in_genai_generator_and_engine_as_the_original_did(
        export, converted_for_genai, peer_python):
    """The chunk width lives in the model's metadata, not in search.chunk_size, which genai's
    static-batching og.Engine refuses: og.Generator and og.Engine run the folder converted with
    --native-chunks off wherever they ran the original, with the same greedy tokens as
    onnx-chunk."""
    converted = converted_for_genai
    config = json.loads((converted / "genai_config.json").read_text())
    assert "chunk_size" not in config["search"]
    runtime = load(converted, provider="cpu")
    assert runtime.stats.chunk_size == CHUNK
    prompt = _prompt(runtime)
    ours = runtime.open_sequence().generate(prompt, NEW_TOKENS)
    generated = [run_child(environment.worker_argv(peer_python, "genai_worker", {
        "model": str(folder), "prompts": [prompt], "new_tokens": NEW_TOKENS, "chunk_size": 0,
        "max_length": runtime.stats.capacity}), timeout_s=300).payload["results"][0]["tokens"]
        for folder in (export.folder, converted)]
    assert generated[0] == generated[1] == ours
    served = [run_child(environment.worker_argv(peer_python, "genai_engine_worker", {
        "model": str(folder), "prompts": [prompt], "new_tokens": NEW_TOKENS, "batch": 1}),
        timeout_s=300).payload for folder in (export.folder, converted)]
    original, ours_served = served
    if "error" in original:
        assert ours_served == original
    else:
        assert "error" not in ours_served, ours_served["error"]
        assert original["tokens"] == ours_served["tokens"] == [ours]


def test_validate_passes_with_the_checker(export, converted, capsys):
    validate_passes(capsys, converted, "1,40,127,129,300")


def test_generate_on_the_file_the_folder_and_the_api_agree(export, capsys):
    runtime = load(export.folder, provider="cpu", chunk_size=CHUNK)
    prompt = _prompt(runtime, 200)
    runs = []
    for target in (export.folder, export.folder / "model.onnx"):
        code, out, err = _cli(capsys, "generate", target, "--ids", ",".join(map(str, prompt)),
                              "--max-new-tokens", NEW_TOKENS, "--provider", "cpu",
                              "--chunk-size", CHUNK, "--json")
        assert code == 0, err
        runs.append(json.loads(out))
    assert runs[0]["tokens"] == runs[1]["tokens"]
    assert runtime.open_sequence().generate(prompt, NEW_TOKENS) == runs[0]["tokens"]


def test_the_device_memory_path_gives_the_host_paths_tokens(export, converted, tmp_path,
                                                           capsys):
    # CUDA's path, run on CPU: buffers off the host, per-width variants sharing one copy of the
    # weights, the capacity mask, and prefill widths that return one logits row (the graph's
    # logits_rows input, or without it logits_row's rewrite of the serialized export), alone
    # and through the batch engine.
    code, _, err = _cli(capsys, "convert", export.folder, "-o", tmp_path / "all-rows",
                        "--chunk-size", CHUNK, "--logits-rows", "off")
    assert code == 0, err
    host = load(converted, provider="cpu")
    prompts = [_prompt(host, length) for length in (40, 300)]
    expected = [host.open_sequence().generate(prompt, NEW_TOKENS) for prompt in prompts]
    for folder in (converted, tmp_path / "all-rows"):
        with load(folder, device=DEVICE) as device:
            assert device.debug.options.select_rows == (device.debug.ports.logits_rows is None)
            assert [device.open_sequence().generate(prompt, NEW_TOKENS)
                    for prompt in prompts] == expected
            assert device.generate_many(prompts, NEW_TOKENS) == expected


def test_the_models_eos_ids_are_the_default_stop(export, tmp_path):
    folder = export.copy_to(tmp_path / "model")
    runtime = load(folder, provider="cpu", chunk_size=CHUNK)
    eos = export.features["eos_token_id"]
    assert runtime.stats.eos_token_ids == (tuple(eos) if isinstance(eos, list) else (eos,))
    prompt = _prompt(runtime, 60)
    free = runtime.open_sequence().generate(prompt, 12, eos_token_id=[])
    config_path = folder / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["eos_token_id"] = [free[4], *runtime.stats.eos_token_ids]
    config_path.write_text(json.dumps(config))
    stopped = load(folder, provider="cpu", chunk_size=CHUNK).open_sequence().generate(prompt, 12)
    assert stopped == free[:free.index(free[4]) + 1]


def test_the_fp16_cpu_export_is_refused_with_one_line(tmp_path, capsys):
    fp16 = [fixture for fixture in fixtures(GENAI) if not fixture.grouped_query_attention]
    assert fp16, "the corpus lost its MultiHeadAttention export"
    for fixture in fp16:
        code, _, err = _cli(capsys, "inspect", fixture.folder)
        assert code == 0, err
        code, _, err = _cli(capsys, "generate", fixture.folder, "--ids", "5,6,7",
                            "--max-new-tokens", 2, "--provider", "cpu")
        assert code == 2 and err.startswith("error:") and err.count("\n") == 1, err


def test_fix_shapes_output_runs_with_the_dynamic_models_tokens(export, tmp_path, capsys):
    code, out, err = _cli(capsys, "fix-shapes", export.folder, "-o", tmp_path / "fs",
                          "--rows", 64, "--capacity", 512)
    window = export.features.get("sliding_window") or 0
    if window > 512:
        # a window-sized cache cannot be shorter than its window: refused, the capacity named
        assert code == 2 and err.startswith("error:") and err.count("\n") == 1, err
        assert f"at least {window} (--capacity)" in err
        assert not (tmp_path / "fs").exists()
        return
    if export.features.get("conv_state"):
        # right-padded fixed-row chunks would fold padding into the conv state: refused, the
        # dynamic runtime named instead
        assert code == 2 and err.startswith("error:") and err.count("\n") == 1, err
        assert "run the dynamic model instead" in err
        assert not (tmp_path / "fs").exists()
        return
    assert code == 0, err
    runtime = load(export.folder, provider="cpu", chunk_size=64, capacity=512)
    prompt = _prompt(runtime, 150)
    expected = runtime.open_sequence().generate(prompt, NEW_TOKENS, eos_token_id=[])
    runner = load_static(tmp_path / "fs", provider="cpu")
    assert list(runner.generate(prompt, NEW_TOKENS).tokens) == expected
    code, out, err = _cli(capsys, "validate", tmp_path / "fs", "--provider", "cpu")
    assert code == 0, out + err


def test_an_export_whose_nodes_read_undefined_values_is_refused_with_one_line(tmp_path, capsys,
                                                                             caplog):
    """onnxruntime-genai 0.18.0's builder, asked for an 8-bit lm_head on a tied model
    (`matmul_mixed_precision=last_matmul:int8`), writes an embedding that reads initializers it
    never saves; ONNX Runtime cannot load such a file. Made here by renaming what a corpus
    export's embedding reads: convert and inspect refuse it in one line naming the node and the
    value and write nothing; validate reports it through onnx's checker."""
    fixture = next(fixture for fixture in builder_gqa_fixtures() if fixture.precision == "int4")
    folder = fixture.copy_to(tmp_path / "broken")
    model_path = folder / "model.onnx"
    proto = onnx.load(str(model_path), load_external_data=False)
    embedding = next(node for node in proto.graph.node if node.op_type == "Gather"
                     and "embed" in node.name)
    embedding.input[0] = "lm_head.MatMul.weight_Q8G32"
    model_path.write_bytes(proto.SerializeToString())

    for argv in (("convert", model_path, "-o", tmp_path / "conv"), ("inspect", model_path)):
        code, out, err = _cli(capsys, *argv)
        assert code == 2 and err.startswith("error:") and err.count("\n") == 1, err
        assert f"node {embedding.name!r} reads 'lm_head.MatMul.weight_Q8G32'" in err, err
        assert out == ""
    # onnx_ir's own warnings for the same names are dropped: the error line says it
    assert not [record for record in caplog.records if "cannot be found" in record.getMessage()]
    assert not (tmp_path / "conv").exists()
    code, out, _ = _cli(capsys, "validate", model_path)
    checker = next(line for line in out.splitlines() if line.startswith("structure.checker"))
    assert code != 0 and "failed" in checker, out
    assert f"name: {embedding.name} OpType: Gather is not output of any previous nodes" \
        in checker, checker


def test_an_export_whose_declared_types_break_onnx_runtimes_rules_is_refused(tmp_path, capsys):
    """onnxruntime-genai 0.18.0's builder, asked for asymmetric INT4 blocks on a tied model
    (`is_symmetric=false`), writes an embedding Reshape that reads the float lm_head weight and
    declares its output uint8; ONNX Runtime refuses the file ("Type Error: ... does not match
    expected type") and onnx's checker accepts it. Made here by declaring a corpus export's
    activation Mul output uint8: ONNX Runtime itself refuses it, convert and inspect refuse it in
    one line naming the node and both types and write nothing, and validate's structure.checker
    fails with it."""
    fixture = next(fixture for fixture in builder_gqa_fixtures() if fixture.precision == "int4")
    folder = fixture.copy_to(tmp_path / "broken")
    model_path = folder / "model.onnx"
    proto = onnx.load(str(model_path), load_external_data=False)
    declared = {info.name: info for info in proto.graph.value_info}
    node = next(node for node in proto.graph.node
                if node.op_type == "Mul" and node.output[0] in declared
                and declared[node.output[0]].type.tensor_type.elem_type == onnx.TensorProto.FLOAT)
    declared[node.output[0]].type.tensor_type.elem_type = onnx.TensorProto.UINT8
    model_path.write_bytes(proto.SerializeToString())
    with pytest.raises(Exception, match="does not match expected type"):
        onnxruntime.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])

    said = (f"node {node.name!r} (Mul) declares its output {node.output[0]!r} as tensor(uint8), "
            "where it is tensor(float)")
    for argv in (("convert", model_path, "-o", tmp_path / "conv"), ("inspect", model_path)):
        code, out, err = _cli(capsys, *argv)
        assert code == 2 and err.startswith("error:") and err.count("\n") == 1, err
        assert said in err and "ONNX Runtime cannot load it" in err, err
        assert out == ""
    assert not (tmp_path / "conv").exists()
    code, out, _ = _cli(capsys, "validate", model_path)
    checker = next(line for line in out.splitlines() if line.startswith("structure.checker"))
    assert code != 0 and "failed" in checker and "ONNX Runtime's type rules" in checker, out
    assert said in checker, checker
