"""The built wheel installs on every platform its users have, with exactly one ONNX Runtime.

For each platform and each runtime extra, pip resolves the wheel's dependencies against PyPI
for that platform (`pip install --dry-run --platform ... --only-binary=:all:`, nothing
installed). pip evaluates environment markers for the machine it runs on, not for --platform,
so the markers of our own extras are evaluated here for the target platform and the requirements
they select are passed to pip beside the wheel (the wheel's base dependencies carry none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from email.parser import Parser
from pathlib import Path
from zipfile import ZipFile

import pytest
from packaging.requirements import Requirement

from onnx_chunk._onnxruntime_wheels import ONNXRUNTIME_WHEELS

ROOT = Path(__file__).resolve().parent.parent
PYTHON = "3.12"
# One worker builds the wheel once: `pip wheel` builds in the checkout's build/, and two workers
# each building it for this module's fixture collide there ("File exists: build/bdist...").
pytestmark = pytest.mark.xdist_group("wheel")



def _manylinux(machine: str) -> list[str]:
    # pip expands a macOS tag to the older versions it accepts, but not a manylinux one.
    return [f"manylinux_2_{minor}_{machine}" for minor in (28, 27, 17)] + \
        [f"manylinux2014_{machine}"]


# name -> (pip's --platform tags, the marker environment of that platform)
PLATFORMS = {
    "linux-x86_64": (_manylinux("x86_64"),
                     {"sys_platform": "linux", "platform_system": "Linux",
                      "platform_machine": "x86_64", "os_name": "posix"}),
    "linux-aarch64": (_manylinux("aarch64"),
                      {"sys_platform": "linux", "platform_system": "Linux",
                       "platform_machine": "aarch64", "os_name": "posix"}),
    "macos-arm64": (["macosx_14_0_arm64"],
                    {"sys_platform": "darwin", "platform_system": "Darwin",
                     "platform_machine": "arm64", "os_name": "posix"}),
    "windows-x86_64": (["win_amd64"],
                       {"sys_platform": "win32", "platform_system": "Windows",
                        "platform_machine": "AMD64", "os_name": "nt"}),
}
# Where onnxruntime-gpu is published; `[cuda]` gives the CPU wheel elsewhere.
CUDA_WHEEL_PLATFORMS = {"linux-x86_64", "windows-x86_64"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                           str(out), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = out.glob("onnx_chunk-*.whl")
    return built


def _requires(wheel: Path) -> list[Requirement]:
    with ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode("utf-8"))
    return [Requirement(line) for line in metadata.get_all("Requires-Dist") or []]


def selected(requires: list[Requirement], extra: str, environment: dict[str, str]) -> list[str]:
    """The requirements `extra` adds on the platform of `environment`, markers dropped."""
    chosen = []
    for requirement in requires:
        marker = requirement.marker
        if marker is None or not marker.evaluate({**environment, "extra": extra}):
            continue
        if marker.evaluate({**environment, "extra": ""}):
            continue  # a base dependency: the wheel brings it
        bare = Requirement(str(requirement))
        bare.marker = None
        chosen.append(str(bare))
    return chosen


def resolve(wheel: Path, platform: str, extra: str, target: Path) -> dict:
    tags, environment = PLATFORMS[platform]
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--quiet", "--report", "-", "--only-binary=:all:", "--python-version", PYTHON,
               "--target", str(target), *[arg for tag in tags for arg in ("--platform", tag)],
               str(wheel), *selected(_requires(wheel), extra, environment)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert done.returncode == 0, (f"{platform} [{extra}] cannot install:\n"
                                  + done.stderr[-3000:])
    return json.loads(done.stdout)


def onnxruntime_wheels(report: dict) -> list[str]:
    return sorted(item["metadata"]["name"].lower() for item in report["install"]
                  if item["metadata"]["name"].lower() in ONNXRUNTIME_WHEELS)


def test_every_platform_installs_exactly_one_onnxruntime(wheel, tmp_path):
    cases = [(platform, extra) for platform in PLATFORMS for extra in ("cpu", "cuda")]
    with ThreadPoolExecutor(4) as pool:
        reports = list(pool.map(lambda case: resolve(wheel, *case, tmp_path / "-".join(case)),
                                cases))
    found = {case: onnxruntime_wheels(report) for case, report in zip(cases, reports)}
    expected = {(platform, extra): ["onnxruntime-gpu" if extra == "cuda"
                                    and platform in CUDA_WHEEL_PLATFORMS else "onnxruntime"]
                for platform, extra in cases}
    assert found == expected


def test_the_base_install_brings_no_onnxruntime(wheel):
    requires = _requires(wheel)
    for _, environment in PLATFORMS.values():
        base = [str(r) for r in requires if r.marker is None
                or r.marker.evaluate({**environment, "extra": ""})]
        assert not [r for r in base if Requirement(r).name.lower() in ONNXRUNTIME_WHEELS]


def test_markers_are_evaluated_for_the_target_platform(wheel):
    requires = _requires(wheel)
    windows, mac = PLATFORMS["windows-x86_64"][1], PLATFORMS["macos-arm64"][1]
    assert [Requirement(r).name for r in selected(requires, "cuda", windows)] == \
        ["onnxruntime-gpu"]
    assert [Requirement(r).name for r in selected(requires, "cuda", mac)] == ["onnxruntime"]


def test_the_wheel_ships_the_type_marker_license_and_version(wheel):
    import onnx_chunk

    with ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    assert "onnx_chunk/py.typed" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), names
    assert f"Version: {onnx_chunk.__version__}\n".encode() in metadata
    assert wheel.name.startswith(f"onnx_chunk-{onnx_chunk.__version__}-")
