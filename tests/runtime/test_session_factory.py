"""Sessions share one copy of the weights; pre-packing only where it pays."""

import numpy as np
import pytest

from onnx_chunk.runtime import load
from onnx_chunk.runtime.device.session_factory import DISABLE_PREPACKING_KEY


def _prepacks(session):
    options = session.get_session_options()
    try:
        return options.get_session_config_entry(DISABLE_PREPACKING_KEY) != "1"
    except Exception:  # ORT raises when the entry was never set: pre-packing is on
        return True


@pytest.mark.parametrize("variant, prefill_prepacks", [("base", False), ("int4", True)])
def test_prepacking_follows_the_rule(reference_model, variant, prefill_prepacks):
    runtime = load(reference_model(variant), provider="cpu", capacity=64, chunk_size=16,
                   specialize=True)
    with runtime.debug.cache.acquire(1) as decode, runtime.debug.cache.acquire(16) as prefill:
        assert _prepacks(decode)
        assert _prepacks(prefill) == prefill_prepacks
    dynamic = load(reference_model(variant), provider="cpu", capacity=64, chunk_size=16,
                   specialize=False)
    with dynamic.debug.cache.acquire(None) as session:
        assert _prepacks(session)


def test_sessions_are_specialised_per_width(reference_model):
    runtime = load(reference_model("base"), provider="cpu", capacity=64, chunk_size=16,
                   specialize=True)
    with runtime.debug.cache.acquire(16) as session:
        shapes = {value.name: value.shape for value in session.get_inputs()}
    assert shapes["input_ids"] == [1, 16]
    assert shapes["past_key_values.0.key"][2] == 64


def test_weights_are_mapped_not_copied(reference_model):
    runtime = load(reference_model("base"), provider="cpu", capacity=64, specialize=True)
    weights = runtime.debug.weights
    assert len(weights.names) == len(weights.values) > 0
    assert weights.nbytes == sum(array.nbytes for array in weights.arrays)
    for value, array in zip(weights.values, weights.arrays):
        assert isinstance(array, np.memmap) and value.data_ptr() == array.ctypes.data


def test_weights_for_another_device_are_not_faulted_in_and_say_they_are_copied(
        reference_model, monkeypatch):
    from onnx_chunk.graph.model_file import read_model_file
    from onnx_chunk.runtime.device import session_factory
    from onnx_chunk.runtime.device.provider import device_for

    faulted = []
    original = session_factory.fault_in
    monkeypatch.setattr(session_factory, "fault_in",
                        lambda array: faulted.append(array.nbytes) or original(array))
    model = read_model_file(reference_model("base"))
    cuda = session_factory.load_shared_weights(model, device_for("cuda"))
    assert faulted == [] and cuda.copied_per_session and cuda.nbytes > 0
    cpu = session_factory.load_shared_weights(model, device_for("cpu"))
    assert sum(faulted) == cpu.nbytes and not cpu.copied_per_session


@pytest.mark.parametrize("specialize", [False, True])
def test_a_graph_given_as_bytes_runs_in_place_of_the_file(reference_model, tmp_path,
                                                          specialize):
    import shutil

    import onnx

    from onnx_chunk.errors import ModelLoadError

    folder = tmp_path / "model"
    shutil.copytree(reference_model("base").parent, folder)
    path = folder / "model.onnx"
    before = {entry.name: entry.stat().st_mtime_ns for entry in folder.iterdir()}
    proto = onnx.load(str(path), load_external_data=False)
    # An edit the output shows: the logits come out negated.
    logits = next(node for node in proto.graph.node if "logits" in node.output)
    logits.output[list(logits.output).index("logits")] = "logits/unnegated"
    proto.graph.node.append(onnx.helper.make_node("Neg", ["logits/unnegated"], ["logits"]))
    ids = np.arange(3, 20)
    with load(path, provider="cpu", capacity=64, specialize=specialize) as runtime:
        plain = runtime.open_sequence().prefill(ids)
    with load(path, provider="cpu", capacity=64, specialize=specialize,
              graph=proto.SerializeToString()) as runtime:
        edited = runtime.open_sequence().prefill(ids)
    np.testing.assert_allclose(edited, -plain, rtol=1e-5, atol=1e-5)
    assert {entry.name: entry.stat().st_mtime_ns for entry in folder.iterdir()} == before
    with pytest.raises(ModelLoadError, match="not a readable ONNX protobuf"):
        load(path, provider="cpu", capacity=64, graph=b"\xff\xff\xff")
