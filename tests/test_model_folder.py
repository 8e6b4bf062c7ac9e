"""Model folders as onnxruntime-genai names them, and what onnx-chunk reads of genai_config.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from onnx_chunk.errors import ModelLoadError
from onnx_chunk.graph.model_folder import locate_model, read_genai_config


def _config(folder: Path, model: dict | None = None, search: dict | None = None,
            decoder: dict | None = None) -> Path:
    document = {"model": {**(model or {}), "decoder": decoder or {}}, "search": search or {}}
    path = folder / "genai_config.json"
    path.write_text(json.dumps(document))
    return path


def test_a_folder_resolves_to_the_decoder_its_config_names(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"")
    (tmp_path / "decoder.onnx").write_bytes(b"")
    _config(tmp_path, decoder={"filename": "decoder.onnx"})
    location = locate_model(tmp_path)
    assert location.onnx_path == tmp_path / "decoder.onnx"
    assert location.genai is not None and location.genai.filename == "decoder.onnx"


@pytest.mark.parametrize("names, expected", [
    (("model.onnx", "other.onnx"), "model.onnx"),
    (("chunk.onnx", "decode.onnx"), "chunk.onnx"),
    (("only.onnx",), "only.onnx"),
])
def test_a_folder_without_config_falls_back_in_order(tmp_path, names, expected):
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert locate_model(tmp_path).onnx_path == tmp_path / expected


def test_an_ambiguous_folder_is_refused_with_the_candidates(tmp_path):
    for name in ("a.onnx", "b.onnx"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ModelLoadError, match="a.onnx, b.onnx"):
        locate_model(tmp_path)


@pytest.mark.parametrize("filename", ["../x/model.onnx", "/etc/passwd", "sub/../../model.onnx"])
def test_a_filename_outside_the_folder_is_refused(tmp_path, filename):
    folder = tmp_path / "m"
    folder.mkdir()
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "model.onnx").write_bytes(b"")
    _config(folder, decoder={"filename": filename})
    with pytest.raises(ModelLoadError, match="outside the model's folder"):
        locate_model(folder)


def test_a_filename_through_a_symlink_out_of_the_folder_is_refused(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (tmp_path / "elsewhere.onnx").write_bytes(b"")
    os.symlink(tmp_path / "elsewhere.onnx", folder / "model.onnx")
    _config(folder, decoder={"filename": "model.onnx"})
    with pytest.raises(ModelLoadError, match="outside"):
        locate_model(folder)


def test_a_missing_named_decoder_is_an_error_not_a_fallback(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"")
    _config(tmp_path, decoder={"filename": "gone.onnx"})
    with pytest.raises(ModelLoadError, match="gone.onnx"):
        locate_model(tmp_path)


def test_the_config_applies_to_the_file_it_names_only(tmp_path):
    for name in ("model.onnx", "b.onnx"):
        (tmp_path / name).write_bytes(b"")
    _config(tmp_path, model={"eos_token_id": 2})
    assert locate_model(tmp_path / "model.onnx").genai.eos_token_ids == (2,)
    assert locate_model(tmp_path / "b.onnx").genai is None


def test_fields_are_read_with_lists_and_search(tmp_path):
    path = _config(tmp_path, model={"eos_token_id": [2, 364], "pad_token_id": 0,
                                    "context_length": 256},
                   search={"max_length": 200, "chunk_size": 64, "top_k": 1},
                   decoder={"head_size": 16})
    config = read_genai_config(path)
    assert config.eos_token_ids == (2, 364)
    assert (config.pad_token_id, config.context_length, config.max_length,
            config.chunk_size, config.head_size) == (0, 256, 200, 64, 16)
    assert config.search["top_k"] == 1


@pytest.mark.parametrize("model, search, message", [
    ({"eos_token_id": "2"}, {}, "eos_token_id"),
    ({"eos_token_id": [2, -1]}, {}, "eos_token_id"),
    ({"eos_token_id": True}, {}, "eos_token_id"),
    ({"context_length": 0}, {}, "context_length"),
    ({}, {"max_length": 2.5}, "max_length"),
    ({}, {"chunk_size": "64"}, "chunk_size"),
])
def test_bad_fields_are_one_clear_error(tmp_path, model, search, message):
    path = _config(tmp_path, model=model, search=search)
    with pytest.raises(ModelLoadError, match=message):
        read_genai_config(path)


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_an_unreadable_config_is_one_clear_error(tmp_path, content):
    (tmp_path / "genai_config.json").write_bytes(content)
    with pytest.raises(ModelLoadError, match="genai_config.json"):
        read_genai_config(tmp_path / "genai_config.json")


@pytest.mark.parametrize(("search", "message"), [
    ({"do_sample": "yes"}, "search.do_sample must be true or false"),
    ({"temperature": "hot"}, "search.temperature must be a number"),
    ({"top_p": True}, "search.top_p must be a number"),
    ({"top_k": 2.5}, "search.top_k must be an integer"),
    ({"random_seed": "1"}, "search.random_seed must be an integer"),
])
def test_search_fields_of_a_wrong_type_are_one_clear_error(tmp_path, search, message):
    with pytest.raises(ModelLoadError, match=message):
        read_genai_config(_config(tmp_path, search=search))


def test_a_config_nested_too_deep_is_one_clear_error(tmp_path):
    path = tmp_path / "genai_config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelLoadError, match="nest too deep"):
        read_genai_config(path)
