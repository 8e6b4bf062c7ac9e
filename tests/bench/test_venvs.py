"""The scratch venvs of scripts/_bench/venvs.py: under the user's cache, pinned, made on first use.

subprocess is faked: nothing is created or installed but the fake interpreter file."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from scripts._bench import environment as env
from scripts._bench import venvs


class FakeRuns:
    """Records the commands; `python -m venv` writes the interpreter, the probe prints
    `installed`."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []
        self.envs: list[dict | None] = []
        self.installed = ""

    def __call__(self, cmd, **kwargs):
        self.commands.append([str(part) for part in cmd])
        self.envs.append(kwargs.get("env"))
        if cmd[1:3] == ["-m", "venv"]:
            python = venvs.interpreter(Path(cmd[3]))
            python.parent.mkdir(parents=True)
            python.write_text("")
        if cmd[1] == "-c":
            return subprocess.CompletedProcess(cmd, 0, self.installed, "")
        return subprocess.CompletedProcess(cmd, 0, "", "")


@pytest.fixture
def runs(monkeypatch):
    fake = FakeRuns()
    monkeypatch.setattr(venvs.subprocess, "run", fake)
    return fake


def test_the_venvs_live_under_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(venvs.ROOT_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache = tmp_path / "xdg" / "onnx-chunk" / "venvs"
    assert venvs.location(venvs.EXPORTERS) == cache / "exporters"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert venvs.venvs_root() == tmp_path / "home" / ".cache" / "onnx-chunk" / "venvs"
    monkeypatch.setenv(venvs.ROOT_ENV, str(tmp_path / "own"))
    assert venvs.location(venvs.LLAMACPP) == tmp_path / "own" / "llamacpp"
    monkeypatch.delenv("ONNX_CHUNK_LLAMACPP_PYTHON", raising=False)
    assert env.llama_python() == venvs.interpreter(tmp_path / "own" / "llamacpp")


def test_a_venv_is_made_and_pinned_on_first_use_and_only_probed_after(runs, monkeypatch,
                                                                     tmp_path, capsys):
    monkeypatch.setenv(venvs.ROOT_ENV, str(tmp_path))
    python = venvs.python(venvs.LLAMACPP)
    assert python == venvs.interpreter(tmp_path / "llamacpp") and python.exists()
    created, probe, install = runs.commands
    assert created[1:] == ["-m", "venv", str(tmp_path / "llamacpp")]
    assert probe[0] == str(python) and probe[-2:] == ["llama-cpp-python", "numpy"]
    assert install[:4] == [str(python), "-m", "pip", "install"]
    assert install[-4:] == ["--no-binary", "llama-cpp-python", "llama-cpp-python==0.3.36",
                            "numpy==2.4.6"]
    assert runs.envs[2]["CMAKE_ARGS"] == "-DLLAMA_CURL=OFF -DGGML_NATIVE=ON"
    said = capsys.readouterr().err
    assert f"creating {tmp_path / 'llamacpp'}" in said and "installing llama-cpp-python" in said

    runs.commands.clear()
    runs.installed = "llama-cpp-python==0.3.36 numpy==2.4.6\n"
    assert venvs.python(venvs.LLAMACPP) == python
    assert len(runs.commands) == 1 and runs.commands[0][1] == "-c"
    assert capsys.readouterr().err == ""


def test_another_version_is_reinstalled_and_a_local_tag_is_not_compared(runs, tmp_path):
    python = venvs.interpreter(tmp_path / "v")
    python.parent.mkdir(parents=True)
    python.write_text("")
    runs.installed = "torch==2.12.0 numpy==2.4.6"
    venvs.pinned_venv(tmp_path / "v", ("torch==2.13.0", "numpy==2.4.6"), venvs.TORCH_CPU_INDEX)
    assert runs.commands[-1][-4:] == [*venvs.TORCH_CPU_INDEX, "torch==2.13.0", "numpy==2.4.6"]
    runs.commands.clear()
    # The probe strips the local tag (2.13.0+cpu prints as 2.13.0), so this matches.
    runs.installed = "torch==2.13.0 numpy==2.4.6"
    venvs.pinned_venv(tmp_path / "v", ("torch==2.13.0", "numpy==2.4.6"))
    assert [command[1] for command in runs.commands] == ["-c"]


def test_every_spec_is_pinned_and_says_the_command_that_makes_it():
    for name, spec in venvs.SPECS.items():
        assert spec.name == name and spec.requirements
        assert all("==" in requirement for requirement in spec.requirements)
        assert spec.command() == f"python scripts/_bench/venvs.py {name}"
    done = subprocess.run(["python3", str(env.WORKERS / "venvs.py"), "nothing"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "exporters|exporters-optimum|llamacpp" in done.stderr


def test_make_bench_models_without_torch_runs_in_the_exporters_venv(runs, monkeypatch, tmp_path):
    import importlib.util

    from scripts import make_bench_models

    monkeypatch.setenv(venvs.ROOT_ENV, str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert make_bench_models.exporters_python() == venvs.interpreter(tmp_path / "exporters")
    install = runs.commands[-1]
    assert "torch==2.13.0" in install and "onnxruntime-genai==0.18.0" in install
    assert install[6:8] == list(venvs.TORCH_CPU_INDEX)


@pytest.mark.parametrize("value, expected", [
    ("", "()"), ("https://example.invalid/whl", "('--extra-index-url', 'https://example.invalid/whl')")])
def test_the_torch_index_follows_its_environment_variable(value, expected):
    import os
    import sys
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", "from scripts._bench import venvs; "
                           "print(venvs.TORCH_CPU_INDEX)"], cwd=root, capture_output=True,
                          text=True, env={**os.environ, "ONNX_CHUNK_TORCH_INDEX": value})
    assert done.stdout.strip() == expected, done.stderr


def test_a_second_caller_waits_while_the_first_is_still_making_the_venv(runs, tmp_path):
    """pytest's workers asked for one venv at once: the second saw the interpreter the first's
    `python -m venv` had written, before its pip, and failed with "No module named pip"."""
    import threading

    making, finish = threading.Event(), threading.Event()
    record = runs.__call__

    def slow_venv(cmd, **kwargs):
        done = record(cmd, **kwargs)
        if cmd[1:3] == ["-m", "venv"]:  # the interpreter exists now; pip does not yet
            making.set()
            assert finish.wait(10)
        return done

    venvs.subprocess.run = slow_venv
    first = threading.Thread(target=venvs.pinned_venv, args=(tmp_path / "v", ()))
    second = threading.Thread(target=venvs.pinned_venv, args=(tmp_path / "v", ()))
    first.start()
    try:
        assert making.wait(10)
        second.start()
        second.join(0.5)
        assert second.is_alive() and [c[1] for c in runs.commands] == ["-m"]
    finally:
        finish.set()
    first.join(10)
    second.join(10)
    # The second only probed the venv the first had finished.
    assert [c[1] for c in runs.commands] == ["-m", "-c", "-c"]
    assert (tmp_path / "v.lock").exists()
