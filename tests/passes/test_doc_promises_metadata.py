"""docs/metadata.md's promises that no other test holds it to."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnx_chunk.cli import main
from onnx_chunk.graph import metadata
from onnx_chunk.graph.model_io import load_model, save_model
from onnx_chunk.ladder import ladder_tiers
from onnx_chunk.passes import convert_model
from onnx_chunk.passes.kv_capacity import find_kv_capacity
from tests.exports.corpus import builder_gqa_fixtures, fixtures

PACKAGE = Path(metadata.__file__).parent

# The keys of `inspect --json`, as the page's table lists them (and json.md's "schema").
INSPECT_KEYS = {"schema", "model", "converted", "schema_version", "chunk_size", "ladder",
                "max_variants", "gqa_nodes", "capacity_inputs", "kv_bindings",
                "max_sequence_length", "problems", "token_input", "per_token_ports",
                "position_ids", "recurrent_state", "state_bindings", "padding", "query_seqlens",
                "logits_rows"}


def test_only_the_metadata_module_spells_the_keys():
    keys = {value for name, value in vars(metadata).items()
            if name.endswith("_KEY") and isinstance(value, str)}
    assert len(keys) >= 12
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(metadata.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in keys:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value}")
    assert not found, found


def _inspect(path, capsys) -> dict:
    assert main(["inspect", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_json_prints_the_documented_keys_whatever_the_model(make_decoder, tmp_path,
                                                                   capsys):
    paths = {}
    for name, options in (("plain", {}), ("nogqa", {"gqa": False})):
        paths[name] = tmp_path / name / "model.onnx"
        save_model(make_decoder(**options), paths[name])
    paths["converted"] = tmp_path / "converted" / "model.onnx"
    assert main(["convert", str(paths["plain"]), "-o", str(paths["converted"])]) == 0
    capsys.readouterr()
    seen = {name: _inspect(path, capsys) for name, path in paths.items()}
    for name, data in seen.items():
        assert set(data) == INSPECT_KEYS, name
    assert seen["converted"]["converted"] and not seen["plain"]["converted"]
    assert seen["converted"]["schema_version"] == metadata.SCHEMA_VERSION
    assert seen["converted"]["model"] == str(paths["converted"])
    assert (seen["converted"]["chunk_size"], seen["converted"]["max_variants"]) == (512, 4)


def test_no_chunk_size_writes_neither_the_size_nor_the_ladder(make_decoder):
    model = make_decoder()
    convert_model(model, chunk_size=None)
    props = model.metadata_props
    assert metadata.CHUNK_SIZE_KEY not in props and metadata.LADDER_KEY not in props
    assert props[metadata.MAX_VARIANTS_KEY] == "4"
    plan = metadata.read_plan(model)
    assert plan is not None and plan.chunk_size is None


@pytest.mark.parametrize("chunk_size, cap", [(512, 4), (64, 2), (100, 7)])
def test_the_ladder_key_is_ladder_tiers(make_decoder, chunk_size, cap):
    model = make_decoder()
    convert_model(model, chunk_size=chunk_size, max_variants=cap)
    assert model.metadata_props[metadata.LADDER_KEY] == ",".join(
        map(str, ladder_tiers(chunk_size, cap)))


def test_optional_keys_are_absent_unless_their_pass_wrote_them(make_decoder):
    model = make_decoder()
    convert_model(model, native_chunks="off", logits_rows="off")
    for key in (metadata.QUERY_SEQLENS_KEY, metadata.LOGITS_ROWS_KEY,
                metadata.MAX_POSITIONS_KEY, metadata.KV_CACHE_KEY, metadata.INT4_BLOCKS_KEY):
        assert key not in model.metadata_props, key


def test_a_window_sized_cache_records_its_window_and_voids_padding():
    checked = 0
    for fixture in fixtures():
        if not fixture.grouped_query_attention:
            continue
        model = load_model(fixture.folder / "model.onnx")
        windows = {}
        for node in model.graph:
            if node.op_type != "GroupQueryAttention":
                continue
            attributes = {name: attr.value for name, attr in node.attributes.items()}
            window = (attributes.get("local_window_size")
                      if attributes.get("sliding_window_cache") else None)
            windows[node.inputs[3].name] = window if window and window > 0 else None
        kv = find_kv_capacity(model)
        by_input = {binding.input: binding.window for binding in kv.bindings}
        for past, window in windows.items():
            if past in by_input:
                assert by_input[past] == window, (fixture, past)
        if any(windows.values()):
            checked += 1
            convert_model(model, native_chunks="off")
            assert not metadata.read_plan(model).padding.eligible, fixture
    assert checked, "no export of the corpus has a window-sized cache"


def test_convert_memory_does_not_grow_with_the_weights(make_decoder_proto, tmp_path):
    proto = make_decoder_proto()
    weight = np.ones((16 << 20,), dtype=np.float32)  # 64 MiB of weights: four copy blocks
    proto.graph.initializer.append(onnx.numpy_helper.from_array(weight, "big_weight"))
    source = tmp_path / "in" / "model.onnx"
    source.parent.mkdir()
    onnx.save_model(proto, str(source), save_as_external_data=True, location="model.onnx.data",
                    size_threshold=0)
    del proto, weight
    out = tmp_path / "out" / "model.onnx"
    tracemalloc.start()
    try:
        assert main(["convert", str(source), "-o", str(out)]) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (out.parent / "model.onnx.data").stat().st_size >= 64 << 20
    # One copy block (staged_output's 16 MiB) and the graph, not the weights.
    assert peak < 24 << 20, peak


def test_head_axes_the_graph_does_not_say_are_null(make_decoder_proto):
    proto = make_decoder_proto()
    for value in (*proto.graph.input, *proto.graph.output):
        if value.name.startswith(("past_key_values.", "present.")):
            for axis, name in ((1, "kv_heads"), (3, "head_dim")):
                dim = value.type.tensor_type.shape.dim[axis]
                dim.Clear()
                dim.dim_param = name
    for node in proto.graph.node:
        if node.op_type == "GroupQueryAttention":
            kept = [a for a in node.attribute if a.name not in ("kv_num_heads", "num_heads")]
            del node.attribute[:]
            node.attribute.extend(kept)
    model = ir.from_proto(proto)
    convert_model(model)
    record = json.loads(model.metadata_props[metadata.KV_CAPACITY_KEY])["kv_bindings"][0]
    assert record["kv_heads"] is None and record["head_size"] is None


def _model_with_tokenizer(reference_model, folder: Path, tokenizer: str) -> Path:
    shutil.copytree(reference_model().parent, folder)
    (folder / "tokenizer.json").write_text(tokenizer)
    return folder / "model.onnx"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_a_companion_with_other_bytes_beside_another_model_is_refused(reference_model,
                                                                      tmp_path, capsys):
    out = tmp_path / "out"
    other = _model_with_tokenizer(reference_model, out, '{"theirs": 1}')
    (other.parent / "genai_config.json").unlink()  # only the tokenizer is at stake
    before = _snapshot(out)
    source = _model_with_tokenizer(reference_model, tmp_path / "in", '{"mine": 1}')
    assert main(["convert", str(source), "-o", str(out / "b.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "tokenizer.json" in err
    assert _snapshot(out) == before
    # The same bytes are shared, not refused.
    (source.parent / "tokenizer.json").write_text('{"theirs": 1}')
    assert main(["convert", str(source), "-o", str(out / "b.onnx")]) == 0
    assert (out / "tokenizer.json").read_text() == '{"theirs": 1}'


def test_a_companion_that_is_not_a_plain_file_is_refused(reference_model, tmp_path, capsys):
    source = tmp_path / "in"
    shutil.copytree(reference_model().parent, source)
    (source / "tokenizer.json").mkdir()
    out = tmp_path / "out"
    assert main(["convert", str(source / "model.onnx"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "tokenizer.json" in err
    assert not out.exists()


def test_max_sequence_length_is_null_without_a_rotary_cache(make_decoder_proto):
    proto = make_decoder_proto()
    for node in proto.graph.node:
        if node.op_type == "GroupQueryAttention":  # inputs 7 and 8: the cos and sin caches
            node.input[7:9] = ["", ""]
    model = ir.from_proto(proto)
    convert_model(model)
    assert json.loads(model.metadata_props[metadata.KV_CAPACITY_KEY])[
        "max_sequence_length"] is None


def test_onnx_runtime_warns_once_at_load_about_the_query_seqlens_initializer(tmp_path):
    out = tmp_path / "out" / "model.onnx"
    source = builder_gqa_fixtures()[0].folder / "model.onnx"
    assert main(["convert", str(source), "-o", str(out), "--logits-rows", "off"]) == 0
    assert metadata.read_query_seqlens(load_model(out)) == "query_seqlens"
    script = ("import onnxruntime as ort, sys; "
              "ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])")
    result = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("Initializer query_seqlens appears in graph inputs") == 1
