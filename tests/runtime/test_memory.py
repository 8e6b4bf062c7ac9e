import mmap

import numpy as np
import pytest

from onnx_chunk.errors import ConfigError
from onnx_chunk.runtime.device import memory
from onnx_chunk.runtime.device.memory import (
    CudaMeter,
    RssMeter,
    cuda_used_bytes,
    measured,
    meter_for,
    peak_rss_bytes,
    process_rss_bytes,
)

MIB = 1 << 20


def _fresh_pages(size: int) -> np.ndarray:
    """`size` bytes written into new anonymous pages: a block malloc could take from memory
    freed earlier in the process (already resident) would not grow the RSS."""
    block = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    block.fill(1)
    return block


def test_rss_sees_a_real_allocation():
    before = process_rss_bytes()
    block = _fresh_pages(64 * MIB)  # written, so its pages are resident
    after = process_rss_bytes()
    assert before is not None and after is not None
    assert after - before >= 60 * MIB
    # The kernel syncs its high-water mark lazily, so compare with the allocation, not `after`.
    assert peak_rss_bytes() >= before + 60 * MIB
    del block


def test_rss_meter_measures_what_an_action_keeps():
    kept, grown = measured(RssMeter(), lambda: _fresh_pages(32 * MIB))
    assert kept.nbytes == 32 * MIB
    assert grown is not None and 28 * MIB <= grown <= 40 * MIB


class _ScriptedMeter:
    name = "scripted"

    def __init__(self, *readings):
        self._readings = list(readings)

    def used_bytes(self):
        return self._readings.pop(0)


@pytest.mark.parametrize("readings,expected", [((100, 350), 250), ((500, 200), 0),
                                               ((None, 10), None), ((10, None), None)])
def test_measured_difference(readings, expected):
    result, grown = measured(_ScriptedMeter(*readings), lambda: "built")
    assert result == "built"
    assert grown == expected


def test_meter_for():
    assert isinstance(meter_for("cpu"), RssMeter)
    cuda = meter_for("cuda", 1)
    assert isinstance(cuda, CudaMeter) and cuda.device_id == 1 and cuda.name == "cuda:1"
    with pytest.raises(ConfigError, match="'npu'"):
        meter_for("npu")


@pytest.fixture
def no_cached_cudart():
    memory.cudart.cache_clear()
    yield
    memory.cudart.cache_clear()


def test_cuda_reading_is_none_without_a_runtime(monkeypatch, no_cached_cudart):
    monkeypatch.setattr(memory, "cudart_candidates", lambda: ["libcudart-that-does-not-exist.so"])
    assert cuda_used_bytes() is None
    assert CudaMeter(0).used_bytes() is None


class _FakeCudart:
    """Answers like libcudart: int status codes, values written through pointers."""

    def __init__(self, free, total, status=0, device=2):
        self.free, self.total, self.status, self.device = free, total, status, device
        self.set_calls = []

    def cudaGetDevice(self, device_ref):
        device_ref.contents.value = self.device
        return 0

    def cudaSetDevice(self, device_id):
        self.set_calls.append(device_id)
        return 0

    def cudaMemGetInfo(self, free_ref, total_ref):
        free_ref.contents.value = self.free
        total_ref.contents.value = self.total
        return self.status


def test_cuda_reading_is_used_memory_and_restores_the_device(monkeypatch):
    fake = _FakeCudart(free=30 * MIB, total=100 * MIB)
    monkeypatch.setattr(memory, "cudart", lambda: fake)
    assert cuda_used_bytes(5) == 70 * MIB
    assert fake.set_calls == [5, 2]


def test_cuda_error_status_reads_none(monkeypatch):
    fake = _FakeCudart(free=1, total=2, status=100)  # cudaErrorNoDevice
    monkeypatch.setattr(memory, "cudart", lambda: fake)
    assert cuda_used_bytes(0) is None
    assert fake.set_calls == [0, 2]

