"""Which ONNX Runtime wheels are installed: exactly one must be, for the provider wanted.

Every ONNX Runtime wheel (the CPU one, the CUDA one, DirectML, OpenVINO...) writes the same
`onnxruntime` module. Two of them in one environment overwrite each other's files, and the
module then loads whichever files won, which breaks the CUDA provider in ways that show only at
run time; so two are refused at once with the command that repairs the environment.
"""

from __future__ import annotations

import functools
from importlib import metadata
from pathlib import Path

from onnx_chunk.errors import InstallError

# The distributions on PyPI that install the `onnxruntime` module.
ONNXRUNTIME_WHEELS = (
    "onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino",
    "onnxruntime-qnn", "onnxruntime-rocm", "onnxruntime-migraphx", "onnxruntime-training",
)


@functools.cache
def installed_wheels() -> dict[str, tuple[str, ...]]:
    """The ONNX Runtime distributions installed, by the folder they are installed in, in
    ONNXRUNTIME_WHEELS order (looked up once per process)."""
    found: dict[str, list[str]] = {}
    for name in ONNXRUNTIME_WHEELS:
        for distribution in metadata.distributions(name=name):
            folder = str(Path(str(distribution.locate_file(""))).resolve())
            if name not in found.setdefault(folder, []):
                found[folder].append(name)
    return {folder: tuple(names) for folder, names in found.items()}


def check_one_wheel() -> None:
    """InstallError when two ONNX Runtime wheels are installed in one folder, naming the fix.

    Wheels in different folders (one on PYTHONPATH, say) do not overwrite each other: the
    first on sys.path is imported whole, so they are left alone.
    """
    for folder, found in installed_wheels().items():
        if len(found) > 1:
            keep = "onnxruntime-gpu" if "onnxruntime-gpu" in found else found[0]
            extra = "cuda" if keep == "onnxruntime-gpu" else "cpu"
            raise InstallError(
                f"{' and '.join(found)} are both installed (in {folder}) and overwrite each "
                f"other's `onnxruntime` module; keep one: pip uninstall -y {' '.join(found)} "
                f"&& pip install 'onnx-chunk[{extra}]'")


def missing_message() -> str:
    """What to install when no ONNX Runtime wheel is there."""
    return ("ONNX Runtime is not installed; install onnx-chunk with one of its wheels: "
            "pip install 'onnx-chunk[cuda]' (NVIDIA GPU, Linux or Windows) or "
            "pip install 'onnx-chunk[cpu]' (any machine)")
