"""Which ONNX Runtime wheels are installed: exactly one must be, for the provider wanted.

Every ONNX Runtime wheel (the CPU one, the CUDA one, DirectML, OpenVINO...) writes the same
`onnxruntime` module. Two of them in one environment overwrite each other's files, and the
module then loads whichever files won, which breaks the CUDA provider in ways that show only at
run time; so two are refused at once with the command that repairs the environment.
"""

from __future__ import annotations

import functools
import os
import re
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


# The oldest ONNX Runtime whose API the CUDA path uses; pyproject.toml's [cuda] extra asks for
# it (tests/cuda/test_ort_versions.py holds the two equal). Measured on the CPU wheels of
# 1.22.1-1.32.0 (the Python layer is the same source in the GPU wheel):
#   - `OrtValue.from_dlpack` (the runtime's own buffers) exists from 1.26.0;
#   - `IOBinding.bind_input` / `bind_output(..., "cuda", id, ...)` (slot rows bound by address,
#     logits ONNX Runtime allocates) build the device through `OrtDevice.make`, which carries
#     NVIDIA's vendor id 0x10DE, from 1.30.0 (vendor 0 in 1.23.2-1.29.0, none before): a
#     device without it is not the CUDA provider's, and a bound input is copied at bind time;
#   - `InferenceSession.release_captured_graph` exists from 1.30.0;
#   - `OrtValue.tensor_size_in_bytes` from 1.23.2.
CUDA_FLOOR = (1, 30)
NVIDIA_VENDOR_ID = 0x10DE


def version_tuple(version: str) -> tuple[int, ...]:
    """(major, minor, ...) of a version string, its leading numeric parts ("1.31.1" ->
    (1, 31, 1); "1.32.0.dev2" -> (1, 32, 0))."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def cuda_api_gaps() -> list[str]:
    """What the installed ONNX Runtime lacks of what the CUDA path uses (empty: nothing)."""
    import onnxruntime as ort
    from onnxruntime.capi import onnxruntime_inference_collection as collection

    gaps = []
    if version_tuple(ort.__version__) < CUDA_FLOOR:
        gaps.append(f"version {ort.__version__} < {'.'.join(map(str, CUDA_FLOOR))}")
    for owner, name in ((ort.OrtValue, "from_dlpack"), (ort.OrtValue, "tensor_size_in_bytes"),
                        (ort.OrtValue, "update_inplace"), (ort.IOBinding, "bind_input"),
                        (ort.IOBinding, "synchronize_inputs")):
        if not callable(getattr(owner, name, None)):
            gaps.append(f"{owner.__name__}.{name}")
    make = getattr(getattr(collection, "OrtDevice", None), "make", None)
    try:
        vendor = make("cuda", 0).device_vendor_id() if make is not None else None
    except Exception:  # ORT's own exception types: an OrtDevice without vendor ids
        vendor = None
    if vendor != NVIDIA_VENDOR_ID:
        gaps.append("an IOBinding device 'cuda' with NVIDIA's vendor id")
    return gaps


def cuda_install_command() -> str:
    """The command that installs an onnxruntime-gpu the CUDA path can use."""
    return f"pip install 'onnxruntime-gpu>={'.'.join(map(str, CUDA_FLOOR))}'"


def check_cuda_api() -> None:
    """InstallError (one line, naming the version to install) where the installed ONNX Runtime
    lacks what the CUDA path uses."""
    gaps = cuda_api_gaps()
    if gaps:
        import onnxruntime as ort

        raise InstallError(f"onnxruntime {ort.__version__} lacks what the CUDA path uses "
                           f"({'; '.join(gaps)}); {cuda_install_command()}")
