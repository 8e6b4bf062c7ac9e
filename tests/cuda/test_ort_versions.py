"""What the CUDA path asks of ONNX Runtime: the version the [cuda] extra installs, the refusal of
an older one at load, and the one CUDA runtime of the process (the one ONNX Runtime maps)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

from onnx_chunk import _onnxruntime_wheels as wheels
from onnx_chunk.errors import InstallError
from onnx_chunk.runtime import load
from onnx_chunk.runtime.device import memory
from onnx_chunk.runtime.device.provider import device_for

ROOT = Path(__file__).resolve().parents[2]
FLOOR = ".".join(map(str, wheels.CUDA_FLOOR))
# CPU wheels of older releases, where a session installed them (scratch, never committed):
# pip install --no-deps --target ~/.cache/onnx-chunk/ort-surface/ort-X.Y.Z onnxruntime==X.Y.Z
SURFACE = Path.home() / ".cache" / "onnx-chunk" / "ort-surface"


def test_the_cuda_extra_asks_for_the_floor_the_code_checks():
    # pyproject.toml's [cuda] extra (read as text: tomllib is 3.11 on, the project 3.10 on).
    text = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^cuda = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL).group(1)
    assert re.findall(r'"(onnxruntime-gpu[^;"]*)', extra) == [f"onnxruntime-gpu>={FLOOR}"]


def test_an_older_onnxruntime_is_refused_at_load_in_one_line(reference_model, monkeypatch):
    monkeypatch.setattr(ort, "__version__", "1.29.0")
    with pytest.raises(InstallError) as refused:
        load(reference_model(dtype="float16"), device=device_for("cuda"), capacity=64)
    message = str(refused.value)
    assert "\n" not in message and "onnxruntime 1.29.0 lacks" in message
    assert message.endswith(f"pip install 'onnxruntime-gpu>={FLOOR}'")


def test_a_missing_api_is_named(monkeypatch):
    monkeypatch.delattr(ort.OrtValue, "from_dlpack")
    assert wheels.cuda_api_gaps() == ["OrtValue.from_dlpack"]


def test_the_installed_wheel_has_the_api():
    assert wheels.cuda_api_gaps() == []


@pytest.mark.parametrize(("version", "gaps"), [("1.29.0", [f"version 1.29.0 < {FLOOR}"]),
                                               ("1.30.0", []), ("1.31.1", [])])
def test_the_surface_of_staged_cpu_wheels(version, gaps):
    # The Python layer of a release is the same in its CPU and GPU wheels.
    folder = SURFACE / f"ort-{version}"
    if not (folder / "onnxruntime").is_dir():
        pytest.skip(f"no onnxruntime {version} CPU wheel staged in {folder}")
    found = subprocess.run(
        [sys.executable, "-c", "from onnx_chunk import _onnxruntime_wheels as w; "
         "print(w.cuda_api_gaps())"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{ROOT}"})
    assert found.stdout.strip().splitlines()[-1] == repr(gaps), found.stderr[-500:]


def test_the_cuda_runtime_is_the_one_onnxruntime_maps():
    # A machine with CUDA 13 installed, onnxruntime-gpu built on CUDA 12 and loaded.
    # /proc/self/maps names the file the soname's link resolves to.
    mapped = ["/usr/local/cuda-13.0/lib64/libcudart.so.13.0.48",
              "/site/nvidia/cuda_runtime/lib/libcudart.so.12.8.90"]
    wheel = ["/site/nvidia/cuda_runtime/lib/libcudart.so.12"]
    assert memory.choose_cudart(mapped, "libcudart.so.12", wheel) == [
        "/site/nvidia/cuda_runtime/lib/libcudart.so.12.8.90", "libcudart.so.12",
        "/site/nvidia/cuda_runtime/lib/libcudart.so.12"]
    # Before ONNX Runtime's provider is loaded: its soname, never the machine's libcudart.so.
    assert memory.choose_cudart(mapped[:1], "libcudart.so.12", []) == ["libcudart.so.12"]
    assert all("libcudart.so.13" not in path and not path.endswith("libcudart.so")
               for path in memory.choose_cudart([], "libcudart.so.12", wheel))
    # A CPU wheel: no provider to share a runtime with; one the process maps, if any.
    assert memory.choose_cudart([], None, []) == []
    assert memory.choose_cudart(mapped[:1], None, []) == mapped[:1]


def test_the_needed_libraries_are_read_from_the_elf_file():
    library = next((Path(ort.__file__).parent / "capi").glob("onnxruntime_pybind11_state*.so"))
    assert "libc.so.6" in memory.elf_needed(library)
    with pytest.raises(ValueError, match="not a little-endian ELF64"):
        memory.elf_needed(ROOT / "pyproject.toml")
