"""Generation on a static pair: `build-model --variant static`, `load_static` and the CLI body."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from onnx_chunk.cli import main
from onnx_chunk.cli.static_generate import run_static_generate
from onnx_chunk.errors import (
    CapacityError,
    ConfigError,
    InputError,
    ModelLoadError,
    ModelStructureError,
)
from onnx_chunk.static import is_static_model, load_static
from onnx_chunk.static.fix_shapes import fix_shapes

from .static_sizes import CAPACITY, CHUNK, MAX_INPUT, SEED


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("static-pair")
    assert main(["build-model", "tiny", "-o", str(out), "--variant", "static", "--chunk-size",
                 str(CHUNK), "--capacity", str(CAPACITY), "--seed", str(SEED)]) == 0
    return out


def _rows_and_capacity(path):
    model = onnx.load(path, load_external_data=False)
    dims = {value.name: [dim.dim_value for dim in value.type.tensor_type.shape.dim]
            for value in model.graph.input}
    return dims["input_ids"][1], dims["past_key_values.0.key"][2]


def _prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, length).tolist()


def test_build_model_static_writes_a_runnable_pair_on_one_data_file(pair_dir):
    assert sorted(path.name for path in pair_dir.iterdir()) == [
        "decode.onnx", "model.onnx", "model.onnx.data"]
    assert _rows_and_capacity(pair_dir / "model.onnx") == (CHUNK, CAPACITY)
    assert _rows_and_capacity(pair_dir / "decode.onnx") == (1, CAPACITY)
    decode = onnx.load(pair_dir / "decode.onnx", load_external_data=False)
    locations = {entry.value for tensor in decode.graph.initializer
                 for entry in tensor.external_data if entry.key == "location"}
    assert locations == {"model.onnx.data"}


def test_static_models_are_detected_and_dynamic_ones_are_not(pair_dir, dynamic_models):
    assert is_static_model(pair_dir) and is_static_model(pair_dir / "decode.onnx")
    assert not is_static_model(dynamic_models(SEED))
    with pytest.raises(ModelStructureError, match="not a static decoder"):
        load_static(dynamic_models(SEED), provider="cpu")


def test_the_static_api_lives_in_its_package_and_at_the_top_level_not_in_the_runtime():
    import onnx_chunk
    import onnx_chunk.runtime
    import onnx_chunk.static

    exported = {name: getattr(onnx_chunk.static, name) for name in onnx_chunk.static.__all__}
    assert exported["load_static"] is load_static and exported["is_static_model"] is is_static_model
    for name in ("StaticLimits", "StaticRunner", "load_static", "suggest_capacity"):
        assert getattr(onnx_chunk, name) is exported[name]
    assert not set(exported) & set(vars(onnx_chunk.runtime))


@pytest.mark.parametrize("length", [3, 16])
def test_the_built_folder_generates_the_dynamic_models_tokens(pair_dir, dynamic_greedy, length):
    runner = load_static(pair_dir, max_input_len=MAX_INPUT, chunk_size=CHUNK,
                         kv_capacity=CAPACITY, provider="cpu")
    prompt = _prompt(length, seed=length)
    new = CAPACITY - MAX_INPUT
    result = runner.generate(prompt, new)
    assert result.tokens == dynamic_greedy(SEED, prompt, new)
    assert result.ttft_s > 0 and result.decode_tokens_per_s > 0
    assert result.decode_steps == new - 1


def test_sizes_that_differ_from_the_graph_are_config_errors(pair_dir):
    with pytest.raises(ConfigError, match=f"chunk size c=8 .* fixed at c={CHUNK}"):
        load_static(pair_dir, chunk_size=8, provider="cpu")
    with pytest.raises(ConfigError, match=f"KV capacity C=32 .* fixed at C={CAPACITY}"):
        load_static(pair_dir, kv_capacity=32, provider="cpu")
    with pytest.raises(ConfigError, match="not a multiple of the chunk size"):
        load_static(pair_dir, max_input_len=10, provider="cpu")


def test_a_missing_decode_graph_says_where_it_was_looked_for(pair_dir, tmp_path):
    for name in ("model.onnx", "model.onnx.data"):
        shutil.copy(pair_dir / name, tmp_path / name)
    with pytest.raises(ModelLoadError, match="no decode graph .*decode.onnx"):
        load_static(tmp_path, provider="cpu")
    runner = load_static(tmp_path, decode_model=pair_dir / "decode.onnx", provider="cpu")
    assert runner.decode_spec.rows == 1


def test_json_reports_truncation_and_strict_refuses(pair_dir):
    runner = load_static(pair_dir, max_input_len=MAX_INPUT, provider="cpu")
    lines: list[str] = []
    long_prompt, short_prompt = _prompt(MAX_INPUT + 5, seed=1), _prompt(6, seed=2)
    results = run_static_generate(runner, [long_prompt, short_prompt], max_new_tokens=3,
                                  as_json=True, echo=lines.append)
    entries = [json.loads(line) for line in lines]
    assert [entry["prompt_tokens"] for entry in entries] == [MAX_INPUT + 5, 6]
    assert [entry["truncated_tokens"] for entry in entries] == [5, 0]
    assert "left-truncated by 5 of 21" in entries[0]["warnings"][0]
    assert entries[1]["warnings"] == [] and entries[1]["pad_count"] == 2
    assert [entry["tokens"] for entry in entries] == [result.tokens for result in results]
    assert all(len(entry["tokens"]) == 3 and entry["ttft_s"] > 0 for entry in entries)
    assert {"dropped_positions", "decode_tokens_per_s"} <= set(entries[0])
    assert [entry["finish_reason"] for entry in entries] == ["length", "length"]
    strict = load_static(pair_dir, max_input_len=MAX_INPUT, provider="cpu", strict=True)
    with pytest.raises(CapacityError, match="left truncation"):
        run_static_generate(strict, [long_prompt], max_new_tokens=3, echo=lines.append)
    with pytest.raises(InputError, match="at most 255"):
        run_static_generate(runner, [short_prompt], max_new_tokens=3, eos_token_id=[3, 256],
                            echo=lines.append)


def test_text_output_has_a_header_and_the_warnings(pair_dir):
    runner = load_static(pair_dir, max_input_len=MAX_INPUT, provider="cpu")
    lines: list[str] = []
    run_static_generate(runner, [_prompt(MAX_INPUT + 2, seed=4)], max_new_tokens=CAPACITY,
                        echo=lines.append)
    header, block = lines
    assert header.startswith(f"static decoder: provider cpu, L={MAX_INPUT}, c={CHUNK}, "
                             f"C={CAPACITY}")
    assert "truncated 2" in block and "warning: prompt left-truncated" in block
    assert "warning: " in block.splitlines()[-1] and "sliding window" in block


@pytest.mark.parametrize("name,flags", [("chunk.onnx", []), (".", []),
                                        ("chunk.onnx", ["--static"])])
def test_fix_shapes_output_generates_the_dynamic_models_tokens_from_file_or_folder(
        fixed_pair, dynamic_greedy, capsys, name, flags):
    prompt = _prompt(9, seed=7)
    new = CAPACITY - MAX_INPUT
    assert main(["generate", str(fixed_pair / name), *flags, "--ids", ",".join(map(str, prompt)),
                 "--max-new-tokens", str(new), "--max-input-len", str(MAX_INPUT),
                 "--provider", "cpu", "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)
    assert entry["tokens"] == dynamic_greedy(SEED, prompt, new)
    assert (entry["aligned_len"], entry["pad_count"], entry["chunks"]) == (12, 3, 3)
    runner = load_static(fixed_pair, chunk_size=CHUNK, kv_capacity=CAPACITY, provider="cpu")
    assert runner.generate(prompt, new).tokens == entry["tokens"]
    assert is_static_model(fixed_pair) and is_static_model(fixed_pair / "decode.onnx")


@pytest.mark.parametrize("name", ["chunk.onnx", "."])
def test_validate_passes_on_fix_shapes_output(fixed_pair, capsys, name):
    assert main(["validate", str(fixed_pair / name), "--provider", "cpu", "--json"]) == 0
    checks = {check["name"]: check["outcome"] for check in json.loads(
        capsys.readouterr().out)["checks"]}
    assert checks["static.graph"] == checks["static.chunked_vs_whole"] == "passed"


def test_validate_reports_a_free_present_dimension_instead_of_crashing(fixed_pair, tmp_path,
                                                                       capsys):
    folder = shutil.copytree(fixed_pair, tmp_path / "fixed")
    chunk = onnx.load(folder / "chunk.onnx", load_external_data=False)
    present = next(value for value in chunk.graph.output if value.name == "present.0.key")
    present.type.tensor_type.shape.dim[2].dim_param = "total_sliding_length"
    onnx.save(chunk, folder / "chunk.onnx")
    assert main(["validate", str(folder), "--provider", "cpu", "--json"]) == 1
    graph = next(check for check in json.loads(capsys.readouterr().out)["checks"]
                 if check["name"] == "static.graph")
    assert graph["outcome"] == "failed" and "total_sliding_length" in graph["reason"]


def test_a_request_past_the_capacity_of_fix_shapes_output_is_one_error_line(fixed_pair, capsys):
    assert main(["generate", str(fixed_pair), "--ids", "5,6,7", "--max-new-tokens",
                 str(CAPACITY), "--provider", "cpu"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "cannot slide" in error and error.count("\n") == 1


def test_validate_refuses_a_chunk_size_that_differs_from_the_static_graphs_rows(pair_dir, capsys):
    assert main(["validate", str(pair_dir), "--chunk-size", str(2 * CHUNK),
                 "--provider", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"chunk size c={2 * CHUNK} was asked for" in captured.err
    assert f"fixed at c={CHUNK}" in captured.err


def test_fix_shapes_output_with_inputs_the_runner_cannot_feed_is_refused(
        reference_model, tmp_path, capsys):
    port = "row_scale"
    fix_shapes(reference_model("odd_port"), tmp_path, rows=CHUNK, capacity=CAPACITY)
    assert main(["generate", str(tmp_path), "--ids", "5,6,7", "--max-new-tokens", "2",
                 "--provider", "cpu"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1
    assert f"{port} that the static runner cannot feed" in error
    assert main(["validate", str(tmp_path), "--provider", "cpu", "--json"]) == 1
    checks = {check["name"]: check for check in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["static.graph"]["outcome"] == "failed"
    assert port in checks["static.graph"]["reason"]


def test_several_eos_ids_stop_a_static_generation_at_the_first_of_them(pair_dir, capsys):
    prompt = ",".join(map(str, _prompt(6, seed=3)))
    command = ["generate", str(pair_dir), "--ids", prompt, "--max-new-tokens", "6",
               "--provider", "cpu", "--json"]
    assert main(command) == 0
    free = json.loads(capsys.readouterr().out)
    tokens = free["tokens"]
    assert free["finish_reason"] == "length" and len(tokens) == 6
    absent = next(token for token in range(256) if token not in tokens)
    assert main([*command, "--eos-token-id", str(absent), "--eos-token-id",
                 str(tokens[3])]) == 0
    stopped = json.loads(capsys.readouterr().out)
    assert stopped["tokens"] == tokens[:tokens.index(tokens[3]) + 1]
    assert stopped["finish_reason"] == "stop"
    assert main([*command[:-1], "--eos-token-id", str(tokens[3])]) == 0
    assert "| finish stop" in capsys.readouterr().out


def test_every_static_prompt_is_checked_before_any_runs(pair_dir, tmp_path, capsys):
    ids = tmp_path / "ids.txt"
    ids.write_text("5 6 7\n8 9\n7 999\n")
    assert main(["generate", str(pair_dir), "--ids-file", str(ids), "--max-new-tokens", "2",
                 "--provider", "cpu", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "outside the vocabulary" in captured.err
