"""Which ONNX Runtime wheels are installed: exactly one must be, for the provider wanted.

Every ONNX Runtime wheel (the CPU one, the CUDA one, DirectML, OpenVINO...) writes the same
`onnxruntime` module. Two of them in one environment overwrite each other's files, and the
module then loads whichever files won, which breaks the CUDA provider in ways that show only at
run time; so two are refused at once with the command that repairs the environment.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from onnx_chunk.errors import InstallError

# The distributions on PyPI that install the `onnxruntime` module.
ONNXRUNTIME_WHEELS = (
    "onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino",
    "onnxruntime-qnn", "onnxruntime-rocm", "onnxruntime-migraphx", "onnxruntime-training",
)


# Installed distributions are folders named "{name}-{version}.dist-info" (".egg-info" for
# older tools), the name normalised (lower case, runs of "-", "_" and "." as one "_").
_BY_FOLDER_NAME = {name.replace("-", "_"): name for name in ONNXRUNTIME_WHEELS}
_INFO_SUFFIXES = (".dist-info", ".egg-info")


def wheel_name(entry: str) -> str | None:
    """The ONNX Runtime distribution whose metadata folder `entry` is, if it is one."""
    if not entry.endswith(_INFO_SUFFIXES):
        return None
    name = entry.partition("-")[0].lower().replace(".", "_")
    return _BY_FOLDER_NAME.get(name)


@functools.cache
def installed_wheels() -> dict[str, tuple[str, ...]]:
    """The ONNX Runtime distributions installed, by the folder they are installed in, in
    ONNXRUNTIME_WHEELS order (looked up once per process).

    The folders of sys.path are listed directly, as importlib.metadata finds distributions:
    importing importlib.metadata alone (it brings the email package) took 0.04 s, a fifth of
    `import onnx_chunk` with ONNX Runtime, for a check that needs only folder names.
    """
    found: dict[str, set[str]] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:  # a zip, a missing folder: no installed wheel there
            continue
        wheels = {wheel for wheel in map(wheel_name, names) if wheel is not None}
        if wheels:
            found.setdefault(str(Path(entry or ".").resolve()), set()).update(wheels)
    return {folder: tuple(name for name in ONNXRUNTIME_WHEELS if name in names)
            for folder, names in found.items()}


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
