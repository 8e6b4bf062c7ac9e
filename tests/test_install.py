"""The installed package: one ONNX Runtime wheel, Windows without POSIX-only modules, the
conventions a Python package keeps (version, license, type marker), the package under test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import onnx_chunk
from onnx_chunk import staged_output
from onnx_chunk.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, *, path: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code)], cwd=ROOT.parent,
                          capture_output=True, text=True, env=env, timeout=300)


def _fake_distribution(folder: Path, name: str) -> Path:
    """A dist-info that importlib.metadata finds: an ONNX Runtime wheel installed beside ours."""
    info = folder / f"{name.replace('-', '_')}-1.22.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.22.0\n")
    return folder


def test_two_onnxruntime_wheels_are_one_clear_error_naming_the_fix(tmp_path, reference_model):
    fake = _fake_distribution(tmp_path / "site", "onnxruntime-gpu")
    _fake_distribution(fake, "onnxruntime")  # both in one folder: their files overwrite
    done = _python(f"""
        import sys
        from onnx_chunk.cli import main
        sys.exit(main(["generate", {str(reference_model())!r}, "--random-prompt", "4",
                       "--max-new-tokens", "2"]))
        """, path=fake)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: onnxruntime and onnxruntime-gpu are both installed (in {fake.resolve()})"), \
        done.stderr
    assert "pip uninstall -y onnxruntime onnxruntime-gpu && pip install 'onnx-chunk[cuda]'" \
        in lines[0]
    api = _python("""
        import onnx_chunk
        try:
            onnx_chunk.load
        except ImportError as error:
            print(type(error).__name__, error)
        """, path=fake)
    assert api.stdout.startswith("InstallError onnxruntime and onnxruntime-gpu are both "
                                 "installed"), api
    direct = _python(f"""
        from onnx_chunk.runtime import load
        try:
            load({str(reference_model())!r}, provider="cpu")
        except ImportError as error:
            print(type(error).__name__, error)
        """, path=fake)
    assert direct.stdout.startswith("InstallError onnxruntime and onnxruntime-gpu are both "
                                    "installed"), direct


def test_metadata_folders_are_read_by_their_normalised_names():
    from onnx_chunk._onnxruntime_wheels import wheel_name

    assert wheel_name("onnxruntime_gpu-1.22.0.dist-info") == "onnxruntime-gpu"
    assert wheel_name("ONNXRuntime-1.22.0.dist-info") == "onnxruntime"
    assert wheel_name("onnxruntime.directml-1.22.0.egg-info") == "onnxruntime-directml"
    assert wheel_name("onnxruntime_genai-0.18.0.dist-info") is None
    assert wheel_name("onnxruntime") is None   # the module's own folder


def test_the_check_imports_no_metadata_library():
    """The check lists folders: importlib.metadata (and the email package it brings) cost
    0.04 s of the import."""
    done = _python("""
        import sys
        from onnx_chunk._onnxruntime_wheels import check_one_wheel
        check_one_wheel()
        print("importlib.metadata" in sys.modules)
        """)
    assert done.stdout.strip() == "False", done.stderr


def test_one_onnxruntime_wheel_passes_the_check():
    from onnx_chunk._onnxruntime_wheels import check_one_wheel, installed_wheels

    assert [len(names) for names in installed_wheels().values()] == [1]
    check_one_wheel()


def test_a_wheel_in_another_folder_shadows_without_conflict(tmp_path, reference_model):
    """onnxruntime-gpu on PYTHONPATH beside the venv's onnxruntime (how a GPU machine gets the
    CUDA wheel staged) writes no file of the other: it runs."""
    fake = _fake_distribution(tmp_path / "site", "onnxruntime-gpu")
    done = _python("""
        from onnx_chunk._onnxruntime_wheels import check_one_wheel, installed_wheels
        check_one_wheel()
        print(sorted(name for names in installed_wheels().values() for name in names))
        """, path=fake)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['onnxruntime', 'onnxruntime-gpu']"


def test_a_missing_onnxruntime_is_one_line_naming_the_extras(reference_model):
    done = _python(f"""
        import sys
        sys.modules["onnxruntime"] = None  # as if no ONNX Runtime wheel were installed
        from onnx_chunk.cli import main
        sys.exit(main(["generate", {str(reference_model())!r}, "--random-prompt", "4",
                       "--max-new-tokens", "2"]))
        """)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: ONNX Runtime is not installed; install onnx-chunk with one of its wheels: "
        "pip install 'onnx-chunk[cuda]' (NVIDIA GPU, Linux or Windows) or "
        "pip install 'onnx-chunk[cpu]' (any machine)"]


def test_without_posix_only_modules_the_package_converts_and_generates(reference_model,
                                                                        tmp_path):
    """Windows has no `resource`, `fcntl`, `termios` nor SIGHUP: simulated by taking them away
    before onnx_chunk is imported."""
    converted = tmp_path / "converted" / "model.onnx"
    done = _python(f"""
        import signal, sys
        for name in ("resource", "fcntl", "termios", "pwd", "grp"):
            sys.modules[name] = None
        del signal.SIGHUP
        from onnx_chunk.cli import main
        from onnx_chunk.runtime.device import memory
        assert memory.peak_rss_bytes() is None
        assert main(["convert", {str(reference_model())!r}, "-o", {str(converted)!r},
                     "--chunk-size", "8"]) == 0
        sys.exit(main(["generate", {str(converted)!r}, "--random-prompt", "20",
                       "--max-new-tokens", "3", "--json"]))
        """)
    assert done.returncode == 0, done.stderr
    assert '"tokens"' in done.stdout or '"generated"' in done.stdout, done.stdout


def test_on_windows_staging_of_another_writer_is_never_probed_with_os_kill(tmp_path,
                                                                           monkeypatch):
    staging = tmp_path / ".model.onnx.123.staging"
    staging.mkdir()
    (staging / ".owner").write_text("999999999\n", encoding="ascii")
    assert staged_output.stale_staging(tmp_path, "model.onnx") == [staging]  # a dead pid: stale

    def kill(pid, signum):
        raise AssertionError("os.kill(pid, 0) ends the process on Windows")

    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(os, "kill", kill)
    assert staged_output.stale_staging(tmp_path, "model.onnx") == []


def test_version_is_printed_and_single_sourced(capsys):
    from importlib import metadata

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"onnx-chunk {onnx_chunk.__version__}\n"
    assert metadata.version("onnx-chunk") == onnx_chunk.__version__
    assert "version =" not in (ROOT / "pyproject.toml").read_text().split("[project]")[1] \
        .split("[")[0]


def test_license_and_type_marker_are_there():
    """(tests/test_platforms.py checks the built wheel ships both)"""
    assert (Path(onnx_chunk.__file__).parent / "py.typed").is_file()
    assert "Copyright (c) 2026 the onnx-chunk authors" in (ROOT / "LICENSE").read_text()


def _editable() -> bool:
    from importlib import metadata

    text = metadata.distribution("onnx-chunk").read_text("direct_url.json") or "{}"
    return bool(json.loads(text).get("dir_info", {}).get("editable"))


def test_the_tests_import_the_installed_package_not_the_checkout():
    """CI installs the built wheel (README's test command): the tests must exercise that copy,
    not the checkout's `onnx_chunk` folder (an editable install is the checkout, on purpose)."""
    if _editable():
        pytest.skip("an editable install: the checkout is the installed package")
    package = Path(onnx_chunk.__file__).resolve().parent
    assert package != ROOT / "onnx_chunk", f"onnx_chunk was imported from the checkout: {package}"
    assert (package / "py.typed").is_file()


def test_the_readme_test_command_installs_the_wheel_not_an_editable_checkout():
    commands = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()
                if line.strip().startswith("python3 -m venv")]
    assert len(commands) == 2 and all(" -e " not in command for command in commands), commands
    assert "test]'" in commands[1] and "pytest" in commands[1]
    assert "onnx-chunk demo" in commands[0]
