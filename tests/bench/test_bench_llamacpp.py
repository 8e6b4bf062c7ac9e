"""The llama.cpp part of the benchmarks: model names, the bare ORT loop, and a quick run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scripts._bench import environment as env
from scripts._bench import venvs
from scripts._bench.child import ChildFailed, run_child
from scripts._bench.harness import seeded_prompt
from scripts._bench.models import (
    BENCH_MODELS,
    BUILDER_PRECISION_ARGS,
    BenchModelMissing,
    bench_model,
    gguf_twins,
    parse_name,
)

EXPORT = env.ROOT / "tests" / "fixtures" / "exports" / "genai-llama-int4"


def test_no_benchmark_shape_has_a_projection_the_builder_takes_for_the_lm_head():
    # The genai builder takes the first nn.Linear with out_features == vocab_size for the
    # lm_head: copy-fp32 widened to hidden 512 = vocab 512 had its logits read after layer 0.
    from scripts._bench import copy_decoder
    from scripts._bench.models import SHAPES
    from scripts.make_bench_models import lm_head_clash

    for shape in SHAPES.values():
        assert lm_head_clash(shape.config) == []
    assert lm_head_clash(copy_decoder.export_config()) == []
    wide_512 = dict(copy_decoder.export_config(), hidden_size=512, intermediate_size=2048,
                    num_attention_heads=16, num_key_value_heads=16)
    assert lm_head_clash(wide_512) == ["q_proj", "k_proj/v_proj",
                                       "o_proj/down_proj (hidden_size)"]
    assert lm_head_clash(dict(copy_decoder.CONFIG, num_hidden_layers=2)) == [
        "gate_proj/up_proj (intermediate_size)"]


def test_the_qwen05_copy_decoder_has_the_qwen05_shape_and_one_trained_head_per_kv_group():
    from scripts._bench import copy_decoder_qwen05 as copy_q05
    from scripts._bench.models import SHAPES
    from scripts.make_bench_models import lm_head_clash

    config, qwen05 = copy_q05.export_config(), SHAPES["qwen05"].config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "tie_word_embeddings"):
        assert config[key] == qwen05[key], key
    assert config["head_dim"] * config["num_attention_heads"] == qwen05["hidden_size"]
    assert copy_q05.CONFIG["num_key_value_heads"] == config["num_key_value_heads"]
    assert copy_q05.query_heads() == {0: 0, 1: 7}  # the first query head of each KV group
    assert lm_head_clash(config) == []
    assert parse_name("copyq05-int4") == ("copyq05", "int4")


def test_model_names_resolve_in_the_cache_and_a_missing_one_says_how_to_build_it(tmp_path):
    assert {"qwen05-int4", "qwen05-fp32", "llama1b-int4", "qwen05-q4_0"} <= set(BENCH_MODELS)
    assert parse_name("llama1b-q8_0") == ("llama1b", "q8_0")
    assert gguf_twins("qwen05-int4") == ["qwen05-q4_0", "qwen05-q8_0"]
    assert parse_name("copy-fp32") == ("copy", "fp32")  # trained here, fp32 only
    assert parse_name("text-int4f") == ("text", "int4f")  # INT4 with a float32 lm_head
    assert parse_name("qwen05-int4h8") == ("qwen05", "int4h8")  # INT4 with an 8-bit lm_head
    # a tied model's 8-bit head shared with the embedding is a file ONNX Runtime cannot load
    assert {"matmul_mixed_precision=last_matmul:int8", "shared_embeddings=false"} <= set(
        BUILDER_PRECISION_ARGS["int4h8"])
    for bad in ("qwen05", "qwen7-int4", "qwen05-int8", "copy-int4", "copy-q4_0"):
        with pytest.raises(BenchModelMissing, match="unknown benchmark model"):
            parse_name(bad)
    with pytest.raises(BenchModelMissing, match="make_bench_models.py qwen05-int4"):
        bench_model("qwen05-int4", tmp_path)
    folder = tmp_path / "qwen05-int4"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"")
    with pytest.raises(BenchModelMissing):  # no BUILD.json: a build that did not finish
        bench_model("qwen05-int4", tmp_path)
    (folder / "BUILD.json").write_text("{}")
    assert bench_model("qwen05-int4", tmp_path) == folder / "model.onnx"
    (tmp_path / "qwen05-q4_0").mkdir()
    (tmp_path / "qwen05-q4_0" / "qwen05-q4_0.gguf").write_bytes(b"")
    (tmp_path / "qwen05-q4_0" / "BUILD.json").write_text("{}")
    assert bench_model("qwen05-q4_0", tmp_path).name == "qwen05-q4_0.gguf"


def test_the_bare_ort_loop_gives_genai_greedy_tokens(peer_python):
    prompt = seeded_prompt(40, 384)
    ours = run_child(env.worker_argv(sys.executable, "ort_loop_worker", {
        "model": str(EXPORT), "prompts": [prompt], "new_tokens": 6, "chunk_size": 16,
        "threads": 1}), timeout_s=120).payload["results"][0]
    theirs = run_child(env.worker_argv(peer_python, "genai_worker", {
        "model": str(EXPORT), "prompts": [prompt], "new_tokens": 6, "chunk_size": 16,
        "threads": 1}), timeout_s=120).payload["results"][0]
    assert len(ours["tokens"]) == 6 and ours["ttft_s"] > 0 and ours["decode_tokens_per_s"] > 0
    assert ours["tokens"][:len(theirs["tokens"])] == theirs["tokens"]


def test_the_quick_run_measures_every_onnx_system_and_says_llama_cpp_is_left_out(
        tmp_path, peer_python):
    result = subprocess.run(
        [sys.executable, str(env.ROOT / "scripts" / "bench_vs_llamacpp.py"), "--model",
         str(EXPORT), "--quick", "--chunk-size", "16", "--out", str(tmp_path), "--genai-venv",
         str(peer_python.parents[1]), "--llama-python", str(tmp_path / "no-such-python"),
         "--no-int8-matmul"],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "llama.cpp LEFT OUT: no llama-cpp-python interpreter" in result.stderr
    table = (tmp_path / "vs_llamacpp_genai-llama-int4_quick.md").read_text()
    assert table.startswith("**llama.cpp LEFT OUT")
    assert "load average before each measurement" in table
    data = json.loads((tmp_path / "vs_llamacpp_genai-llama-int4_quick.json").read_text())
    assert data["systems"] == ["onnx-chunk", "onnx-chunk 4-bit", "genai", "ort-loop"]
    assert data["lengths"] == [40, 300] and len(data["load_averages"]) == 8
    models = tmp_path / "models"
    assert "MatMulInteger" in _op_types(models / "genai-llama-int4-converted-16" / "model.onnx")
    record = json.loads((models / "genai-llama-int4-converted-16" / env.CONVERTED_RECORD)
                        .read_text())
    assert record["matmuls"].startswith("matmuls: int8")
    assert "MatMulInteger" not in _op_types(models / "genai-llama-int4-converted-16-int4"
                                            / "model.onnx")
    for length in data["lengths"]:
        # The default's layers are int8 matmuls; the 4-bit arm keeps the loop's weights.
        ours, loop = data["runs"][f"{length}/onnx-chunk"][0], data["runs"][f"{length}/ort-loop"][0]
        kept = data["runs"][f"{length}/onnx-chunk 4-bit"][0]
        assert len(ours["tokens"]) == len(loop["tokens"]) == 8
        assert kept["tokens"] == loop["tokens"]
        for system in data["systems"]:
            run = data["runs"][f"{length}/{system}"][0]
            assert run["ttft_s"] > 0 and run["peak_rss_mb"] > 10


def test_a_reblocked_arm_is_measured_beside_onnx_chunk_with_its_own_table(tmp_path,
                                                                          peer_python):
    """--int4-block-size N: the export converted with re-blocked weights runs as "onnx-chunk
    bN" in the same rounds; a second table gives its ratios and its leading tokens equal to
    onnx-chunk's."""
    result = subprocess.run(
        [sys.executable, str(env.ROOT / "scripts" / "bench_vs_llamacpp.py"), "--model",
         str(EXPORT), "--quick", "--lengths", "40", "--chunk-size", "16", "--int4-block-size",
         "64", "--out", str(tmp_path), "--genai-venv", str(peer_python.parents[1]),
         "--llama-python", str(tmp_path / "no-such-python")],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    converted = tmp_path / "models" / "genai-llama-int4-converted-16-b64" / "model.onnx"
    assert _block_sizes(converted) == {64}
    plain = tmp_path / "models" / "genai-llama-int4-converted-16" / "model.onnx"
    assert _block_sizes(plain) == {32}
    data = json.loads((tmp_path / "vs_llamacpp_genai-llama-int4_quick.json").read_text())
    assert data["systems"] == ["onnx-chunk", "onnx-chunk b64", "genai", "ort-loop"]
    assert data["int4_block_size"] == 64
    table = (tmp_path / "vs_llamacpp_genai-llama-int4_quick.md").read_text()
    assert "onnx-chunk b64 / this, TTFT s" in table
    assert "leading tokens = onnx-chunk's" in table


def test_an_int8_arm_is_measured_beside_onnx_chunk_with_its_own_table(tmp_path, peer_python):
    """--int8-matmul: the export converted with int8 MatMulInteger layers runs as
    "onnx-chunk int8" in the same rounds, with a table of its own."""
    result = subprocess.run(
        [sys.executable, str(env.ROOT / "scripts" / "bench_vs_llamacpp.py"), "--model",
         str(EXPORT), "--quick", "--lengths", "40", "--chunk-size", "16", "--int8-matmul",
         "--out", str(tmp_path), "--genai-venv", str(peer_python.parents[1]),
         "--llama-python", str(tmp_path / "no-such-python")],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    converted = tmp_path / "models" / "genai-llama-int4-converted-16-int8" / "model.onnx"
    assert _op_types(converted) >= {"MatMulInteger"}
    data = json.loads((tmp_path / "vs_llamacpp_genai-llama-int4_quick.json").read_text())
    assert data["systems"] == ["onnx-chunk", "onnx-chunk int8", "genai", "ort-loop"]
    assert data["int8_matmul"] is True
    table = (tmp_path / "vs_llamacpp_genai-llama-int4_quick.md").read_text()
    assert "onnx-chunk int8 / this, TTFT s" in table


def _op_types(model) -> set[str]:
    import onnx

    return {node.op_type for node in onnx.load(str(model), load_external_data=False).graph.node}


def _block_sizes(model) -> set[int]:
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    return {attribute.i for node in graph.node if node.op_type == "MatMulNBits"
            for attribute in node.attribute if attribute.name == "block_size"}


def _amx_build(llama_python) -> bool:
    """Whether that llama-cpp-python was built with its AMX kernels (its system info says so)."""
    done = subprocess.run([str(llama_python), "-c", "import llama_cpp; "
                           "print(llama_cpp.llama_print_system_info().decode())"],
                          capture_output=True, text=True, timeout=120, check=False)
    return "AMX_INT8 = 1" in done.stdout


def test_an_unknown_model_is_one_clear_line_and_exit_2(tmp_path):
    result = subprocess.run(
        [sys.executable, str(env.ROOT / "scripts" / "bench_vs_llamacpp.py"), "--model",
         "qwen05-int4", "--models-root", str(tmp_path), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: benchmark model qwen05-int4 is not built in {tmp_path}; build it with "
        "`python scripts/make_bench_models.py qwen05-int4` "
        "(see its --help)"]


def test_bench_vs_genai_takes_a_builder_export_with_model(tmp_path, peer_python):
    """--model: the export converted once, both systems stopping at its own EOS ids."""
    result = subprocess.run(
        [sys.executable, str(env.ROOT / "scripts" / "bench_vs_genai.py"), "--quick", "--model",
         str(EXPORT), "--lengths", "40", "--out", str(tmp_path), "--genai-venv",
         str(peer_python.parents[1])], capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "models" / "genai-llama-int4-converted-512" / "model.onnx").is_file()
    data = json.loads((tmp_path / "vs_genai_genai-llama-int4_quick.json").read_text())
    assert data["model"] == str(EXPORT) and data["lengths"] == [40]
    runs = data["runs"]["40/onnx-chunk"] + data["runs"]["40/genai"]
    assert len(runs) == 4 and all(run["tokens"] == runs[0]["tokens"] for run in runs)
    assert "| 40 |" in (tmp_path / "vs_genai_genai-llama-int4_quick.md").read_text()


def test_the_llamacpp_worker_runs_a_real_size_gguf_greedily():
    """Where the llama.cpp venv and qwen05-q4_0 are built (docs/benchmarks.md says how): the
    worker decodes the prompt in chunks and gives the same greedy tokens for the same prompt."""
    try:
        gguf = bench_model("qwen05-q4_0")
    except BenchModelMissing as error:
        pytest.skip(f"LLAMA.CPP NOT TESTED: {error}")
    llama_python = env.llama_python()
    if not llama_python.exists():
        pytest.skip(f"LLAMA.CPP NOT TESTED: no llama-cpp-python interpreter at {llama_python}; "
                    f"`{venvs.LLAMACPP.command()}` makes it")
    prompt = seeded_prompt(40, 151936)
    try:
        payload = run_child(env.worker_argv(llama_python, "llamacpp_worker", {
            "model": str(gguf), "prompts": [prompt, prompt], "new_tokens": 4, "chunk_size": 16,
            "threads": 2}), timeout_s=300).payload
    except ChildFailed as failure:
        if "exited with -11" in str(failure) and _amx_build(llama_python):
            pytest.skip("LLAMA.CPP NOT TESTED: its AMX kernel crashed on this CPU "
                        "(ggml_backend_amx_mul_mat, llama.cpp#20824); build llama-cpp-python "
                        "without AMX and set ONNX_CHUNK_LLAMACPP_PYTHON to its interpreter "
                        "(docs/benchmarks.md, section 7)")
        raise
    first, second = payload["results"]
    assert len(first["tokens"]) == 4 and first["tokens"] == second["tokens"]
    assert all(3 <= token < 151936 for token in first["tokens"])
    assert first["ttft_s"] > 0 and first["decode_tokens_per_s"] > 0
    assert payload["system_info"].startswith("CPU")


def test_the_batched_part_measures_each_sequence_count_and_a_row_keeps_its_tokens(tmp_path):
    """--sequences 1,2 --only-batched: onnx-chunk's batch engine at one and two users (llama.cpp
    left out without its venv); the first prompt's tokens are the same alone and batched."""
    result = subprocess.run(
        [sys.executable, str(env.ROOT / "scripts" / "bench_vs_llamacpp.py"), "--model",
         str(EXPORT), "--quick", "--chunk-size", "16", "--sequences", "1,2", "--only-batched",
         "--batch-prompt", "24", "--out", str(tmp_path), "--llama-python",
         str(tmp_path / "no-such-python")],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "vs_llamacpp_genai-llama-int4_quick.json").read_text())
    assert data["lengths"] == [] and data["sequences"] == [1, 2] and data["runs"] == {}
    alone, batched = data["batched"]["1/onnx-chunk"][0], data["batched"]["2/onnx-chunk"][0]
    assert len(alone["tokens"]) == 1 and len(batched["tokens"]) == 2
    assert batched["tokens"][0] == alone["tokens"][0] and len(alone["tokens"][0]) == 8
    assert batched["rows_per_decode_step"] > 1.5 and batched["decode_tokens_per_s"] > 0
    table = (tmp_path / "vs_llamacpp_genai-llama-int4_quick.md").read_text()
    assert "Batched: 1, 2 sequences of 24 prompt tokens, 8 new each" in table
    assert "| 2 | onnx-chunk |" in table
    refused = subprocess.run(
        [sys.executable, str(env.ROOT / "scripts" / "bench_vs_llamacpp.py"), "--model",
         str(EXPORT), "--only-batched", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "error: --only-batched needs --sequences")


def _llamacpp_or_skip(name: str):
    """(the GGUF benchmark model `name`, llama-cpp-python's interpreter); the test is skipped,
    saying so, where either is not built."""
    try:
        gguf = bench_model(name)
    except BenchModelMissing as error:
        pytest.skip(f"LLAMA.CPP NOT TESTED: {error}")
    llama_python = env.llama_python()
    if not llama_python.exists():
        pytest.skip(f"LLAMA.CPP NOT TESTED: no llama-cpp-python interpreter at {llama_python}")
    return gguf, llama_python


def test_the_llamacpp_batch_worker_decodes_sequences_as_the_lone_worker_does():
    """Where the llama.cpp venv and qwen05-q4_0 are built: two sequences decoded in one
    llama_batch per step give each prompt the tokens the one-sequence worker gives it."""
    gguf, llama_python = _llamacpp_or_skip("qwen05-q4_0")
    prompts = [seeded_prompt(20, 151936), seeded_prompt(27, 151936, seed=1)]
    request = {"model": str(gguf), "prompts": prompts, "new_tokens": 4, "chunk_size": 16,
               "threads": 2}
    batched = run_child(env.worker_argv(llama_python, "llamacpp_batch_worker", request),
                        timeout_s=300).payload
    lone = run_child(env.worker_argv(llama_python, "llamacpp_worker", request),
                     timeout_s=300).payload
    assert batched["tokens"] == [result["tokens"] for result in lone["results"]]
    assert batched["decode_forwards"] == 3 and batched["rows_per_decode_step"] == 2.0
    assert batched["wall_s"] > batched["decode_s"] > 0


def test_the_llamacpp_accuracy_worker_scores_and_decodes_as_the_greedy_worker_does():
    """Where the llama.cpp venv and text-q4_0 are built: the accuracy worker's free-running
    tokens are the greedy worker's, its teacher-forced argmax along them is them again, and
    each window is scored on every row but its last."""
    gguf, llama_python = _llamacpp_or_skip("text-q4_0")
    prompt, window = seeded_prompt(16, 2048), seeded_prompt(40, 2048)
    payload = run_child(env.worker_argv(llama_python, "llamacpp_accuracy_worker", {
        "model": str(gguf), "windows": [window], "prompts": [prompt], "new_tokens": 6,
        "chunk_size": 16, "threads": 2, "forced_paths": [None]}), timeout_s=300).payload
    greedy = run_child(env.worker_argv(llama_python, "llamacpp_worker", {
        "model": str(gguf), "prompts": [prompt], "new_tokens": 6, "chunk_size": 16,
        "threads": 2}), timeout_s=300).payload["results"][0]["tokens"]
    assert payload["free"] == [greedy] and payload["forced"] == [greedy]
    assert payload["scored"] == 39 and len(payload["argmax"][0]) == 39
    assert payload["nll_sum"] > 0


def test_a_converted_folder_without_its_record_is_converted_again(tmp_path):
    """A benchmark folder converted before (no record of its options, or other ones) is not
    measured under the name of today's conversion: converted again."""
    target = env.converted_export(tmp_path, "genai-llama-int4", EXPORT, 16, int8_matmul=False)
    record = target.parent / env.CONVERTED_RECORD
    assert json.loads(record.read_text())["options"][-1] == "--no-int8-matmul"
    record.unlink()
    stamp = target.stat().st_mtime_ns
    assert env.converted_export(tmp_path, "genai-llama-int4", EXPORT, 16,
                                int8_matmul=False) == target
    assert record.is_file() and target.stat().st_mtime_ns != stamp
    stamp = target.stat().st_mtime_ns
    env.converted_export(tmp_path, "genai-llama-int4", EXPORT, 16, int8_matmul=False)
    assert target.stat().st_mtime_ns == stamp  # reused
