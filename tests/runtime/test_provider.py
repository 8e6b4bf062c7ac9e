"""Provider selection: one mapping from a provider name to a device and its mask policy."""

import pytest

from onnx_chunk.errors import ConfigError, ProviderError
from onnx_chunk.runtime.device import provider as provider_module
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for, resolve_device


def test_cpu_device():
    device = resolve_device("cpu")
    assert (device.provider, device.device_type, device.host_visible) == ("cpu", "cpu", True)
    assert device.mask_policy is MaskPolicy.LOGICAL
    assert device.session_providers[0][0] == "CPUExecutionProvider"


def test_cuda_device_mapping_is_data_only():
    device = device_for("cuda", 1)
    assert (device.device_type, device.device_id, device.host_visible) == ("cuda", 1, False)
    assert device.mask_policy is MaskPolicy.CAPACITY
    assert device.session_providers[0] == ("CUDAExecutionProvider", {"device_id": "1"})
    assert device.label == "cuda:1"


def test_mask_policy_override():
    assert device_for("cpu", mask_policy="capacity").mask_policy is MaskPolicy.CAPACITY
    with pytest.raises(ConfigError, match="mask policy"):
        device_for("cpu", mask_policy="wide")


def test_unknown_provider():
    with pytest.raises(ConfigError, match="auto, cuda, cpu"):
        resolve_device("tpu")


def test_auto_and_cuda_follow_the_probe(monkeypatch):
    monkeypatch.setattr(provider_module, "cuda_failure", lambda device_id: "no GPU here")
    assert resolve_device("auto").provider == "cpu"
    with pytest.raises(ProviderError, match="no GPU here"):
        resolve_device("cuda")
    monkeypatch.setattr(provider_module, "cuda_failure", lambda device_id: None)
    assert resolve_device("auto", 2).label == "cuda:2"


class _CreatedSession:
    """A session as ONNX Runtime creates it: `runs_on` is the provider it really got."""

    runs_on = "CPUExecutionProvider"

    def __init__(self, model, options, providers):
        self.asked = providers

    def get_providers(self):
        return [self.runs_on, "CPUExecutionProvider"]


@pytest.fixture
def cuda_listed(monkeypatch):
    """An onnxruntime build that lists CUDA as available, whose sessions are `_CreatedSession`."""
    module_ort = provider_module.ort
    monkeypatch.setattr(module_ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(module_ort, "preload_dlls", lambda: None, raising=False)
    monkeypatch.setattr(module_ort, "InferenceSession", _CreatedSession)
    provider_module.cuda_failure.cache_clear()
    yield monkeypatch
    provider_module.cuda_failure.cache_clear()


def test_probe_checks_the_created_session(cuda_listed):
    """onnxruntime-gpu lists CUDA as available without a GPU; the probe must not trust that:
    a CUDA session that ONNX Runtime created on the CPU provider means no CUDA."""
    assert "fell back to the CPU provider" in provider_module.probe_cuda(0)
    assert resolve_device("auto").provider == "cpu"
    with pytest.raises(ProviderError, match="cannot run on this machine.*fell back to the CPU"):
        resolve_device("cuda")
    cuda_listed.setattr(_CreatedSession, "runs_on", "CUDAExecutionProvider")
    provider_module.cuda_failure.cache_clear()
    assert provider_module.probe_cuda(0) is None
    assert resolve_device("auto", 3).label == "cuda:3"


def test_specialisation_default_lives_in_the_device():
    # One session per model on both: CUDA's fixed shapes are graphs on it, not sessions.
    assert device_for("cpu").specialize is False
    assert device_for("cuda").specialize is False


class _NoisyLibraryFailure(Exception):
    """What a fake CUDA session raises after writing to fd 2, as ORT's C++ loader does."""


def test_the_cuda_probe_prints_nothing_and_logs_why(monkeypatch, capfd, caplog):
    import os

    def noisy_preload():
        os.write(2, b"Failed to load libcudart.so.13\n")

    def noisy_session(*args, **kwargs):
        os.write(2, b"Failed to load libcublasLt.so.13 ... Please follow https://onnxruntime.ai\n")
        raise _NoisyLibraryFailure("CUDA_PATH is set but CUDA wasn't able to be loaded")

    module_ort = provider_module.ort
    monkeypatch.setattr(module_ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(module_ort, "preload_dlls", noisy_preload, raising=False)
    monkeypatch.setattr(module_ort, "InferenceSession", noisy_session)
    provider_module.cuda_failure.cache_clear()
    caplog.set_level("INFO", logger=provider_module.__name__)
    try:
        chosen = resolve_device("auto", 7)
    finally:
        provider_module.cuda_failure.cache_clear()
    os.write(2, b"after the probe\n")
    captured = capfd.readouterr()
    assert chosen.provider == "cpu"
    assert captured.err == "after the probe\n"  # the probe's noise went nowhere, fd 2 is back
    assert "CUDA wasn't able to be loaded" in caplog.text
    assert any(record.levelname == "INFO" and "CUDA unusable" in record.getMessage()
               for record in caplog.records)


def test_the_probe_model_is_the_identity_model_onnx_writes():
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert provider_module.PROBE_MODEL == model.SerializeToString()
