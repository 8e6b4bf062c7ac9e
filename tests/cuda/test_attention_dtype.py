"""CUDA's GroupQueryAttention runs float16 and bfloat16 only: a float32 decoder is refused on
"cuda" and runs on CPU under "auto"."""

import pytest

from onnx_chunk.errors import ProviderError
from onnx_chunk.runtime import facade, load
from onnx_chunk.runtime.device.provider import device_for


def test_float32_attention_is_refused_on_cuda(reference_model):
    with pytest.raises(ProviderError, match="float16"):
        load(reference_model("base"), device=device_for("cuda"), capacity=64)


def test_auto_runs_a_float32_decoder_on_cpu_when_the_gpu_cannot(reference_model, monkeypatch):
    monkeypatch.setattr(facade, "resolve_device", lambda *args: device_for("cuda"))
    runtime = load(reference_model("base"), provider="auto", capacity=64, chunk_size=16)
    assert runtime.stats.provider == "cpu"
    assert len(runtime.open_sequence().generate([1, 2, 3], 2)) == 2
