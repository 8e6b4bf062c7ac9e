"""Native chunks off the CPU run only where this ONNX Runtime build was checked on the device
(device/native_trust.py): a schema with `query_seqlens` is not a kernel that honours it."""

import dataclasses

import pytest

from onnx_chunk.graph import metadata
from onnx_chunk.graph.model_io import load_model, save_model
from onnx_chunk.graph.query_seqlens import query_seqlens_index
from onnx_chunk.passes import QuerySeqlensPass, convert_model
from onnx_chunk.runtime import load, loading
from onnx_chunk.runtime.device import native_trust
from onnx_chunk.runtime.device.provider import device_for
from tests.exports.corpus import fixtures


def test_a_device_other_than_the_cpu_needs_a_recorded_check(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNX_CHUNK_CACHE", str(tmp_path))
    cuda = device_for("cuda")
    assert native_trust.native_refusal(device_for("cpu")) is None
    refusal = native_trust.native_refusal(cuda)
    assert "not verified on cuda:0" in refusal and "scripts/gpu_first_run.sh" in refusal
    path = native_trust.record_verified(cuda, "padded = unpadded (test)")
    assert path.parent == tmp_path / "native-chunks"
    assert native_trust.native_refusal(cuda) is None
    # Another device id of the same build shares the record; another device type does not.
    assert native_trust.native_refusal(dataclasses.replace(cuda, device_id=1)) is None
    assert native_trust.build_key(device_for("cpu")) != native_trust.build_key(cuda)


@pytest.mark.skipif(query_seqlens_index() is None, reason="this ONNX Runtime has no query_seqlens")
def test_an_unverified_device_loads_a_native_folder_without_native_chunks(tmp_path,
                                                                          monkeypatch):
    source = next(fixture.folder for fixture in fixtures() if fixture.name == "genai-llama-fp32")
    model = convert_model(load_model(source / "model.onnx"), native_chunks="off").model
    QuerySeqlensPass("on", index=query_seqlens_index())(model)
    assert metadata.read_query_seqlens(model) == "query_seqlens"
    save_model(model, tmp_path / "wired" / "model.onnx", companions_from=source)
    assert load(tmp_path / "wired", provider="cpu", chunk_size=16,
                padding=True).stats.padding == "native"
    monkeypatch.setattr(loading, "native_refusal", lambda device: "not verified (test)")
    runtime = load(tmp_path / "wired", provider="cpu", chunk_size=16, padding=True)
    assert runtime.stats.padding == "repeat" and runtime.debug.ports.query_seqlens is None
