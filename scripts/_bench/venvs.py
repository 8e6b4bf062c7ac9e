"""Scratch venvs for the exporters and the peers: pinned, made under the user's cache on first use.

A venv is named for its spec and lives in $ONNX_CHUNK_VENVS, else $XDG_CACHE_HOME/onnx-chunk/venvs,
else ~/.cache/onnx-chunk/venvs. The first script that needs one creates it and installs the pinned
requirements, saying so on stderr; later runs only probe the installed versions. Processes that
ask for one venv at once (pytest's workers) take turns on a lock file beside it, so none sees a
venv another is still making. Standard library only (the exporters venv imports it too). Making
one ahead of time prints its interpreter:

    python scripts/_bench/venvs.py exporters|exporters-optimum|llamacpp
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT_ENV = "ONNX_CHUNK_VENVS"
# torch's CPU wheels (no CUDA libraries): the exports are made and checked on the CPU.
# $ONNX_CHUNK_TORCH_INDEX names another index, or, set empty, none (a machine that reaches only
# PyPI, or has the wheel in its pip configuration, would otherwise retry the index per package).
_TORCH_INDEX = os.environ.get("ONNX_CHUNK_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
TORCH_CPU_INDEX = ("--extra-index-url", _TORCH_INDEX) if _TORCH_INDEX else ()


@dataclass(frozen=True)
class VenvSpec:
    """A venv's name, its pinned requirements, extra pip options and environment for the install."""

    name: str
    requirements: tuple[str, ...]
    pip_args: tuple[str, ...] = ()
    install_env: tuple[tuple[str, str], ...] = ()

    def command(self) -> str:
        """The command that makes this venv (for messages that say how to get it)."""
        return f"python scripts/_bench/venvs.py {self.name}"


# The export fixtures' and bench models' venvs (scripts/make_export_fixtures.py): two, because
# onnxruntime-genai 0.18's builder imports classes only transformers 5 has, while optimum-onnx
# 0.1 requires transformers < 4.58. The versions are tests/fixtures/exports/MANIFEST.json's.
EXPORTERS = VenvSpec("exporters", (
    "torch==2.13.0", "transformers==5.24.0", "onnxruntime-genai==0.18.0", "onnxruntime==1.32.0",
    "onnx==1.23.2", "onnxscript==0.7.2", "onnx-ir==1.1.0", "tokenizers==0.23.3",
    "numpy==2.4.6"), TORCH_CPU_INDEX)
EXPORTERS_OPTIMUM = VenvSpec("exporters-optimum", (
    "torch==2.13.0", "transformers==4.57.6", "optimum-onnx==0.1.0", "optimum==2.1.0",
    "onnxruntime==1.32.0", "onnx==1.23.2", "onnxscript==0.7.2", "onnx-ir==1.1.0",
    "tokenizers==0.22.2"), TORCH_CPU_INDEX)
# llama-cpp-python, built from its sdist (a C++ build: minutes, needs cmake and a compiler), for
# the GGUF quantizer and the llama.cpp benchmark.
LLAMACPP = VenvSpec("llamacpp", ("llama-cpp-python==0.3.36", "numpy==2.4.6"),
                    ("--no-binary", "llama-cpp-python"),
                    (("CMAKE_ARGS", "-DLLAMA_CURL=OFF -DGGML_NATIVE=ON"),))
SPECS = {spec.name: spec for spec in (EXPORTERS, EXPORTERS_OPTIMUM, LLAMACPP)}


def venvs_root() -> Path:
    """$ONNX_CHUNK_VENVS, else $XDG_CACHE_HOME/onnx-chunk/venvs, else ~/.cache/onnx-chunk/venvs."""
    if os.environ.get(ROOT_ENV):
        return Path(os.environ[ROOT_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "onnx-chunk" / "venvs"


def location(spec: VenvSpec) -> Path:
    """Where `spec`'s venv lives (made or not)."""
    return venvs_root() / spec.name


def interpreter(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def python(spec: VenvSpec) -> Path:
    """The interpreter of `spec`'s venv under the cache, made first if missing."""
    return pinned_venv(location(spec), spec.requirements, spec.pip_args, dict(spec.install_env))


def _dist(requirement: str) -> str:
    """The distribution a pinned requirement names (``lm-eval[api]==0.4.13`` -> ``lm-eval``)."""
    return re.sub(r"\[.*\]", "", requirement.partition("==")[0])


if sys.platform == "win32":
    import msvcrt

    def _lock(handle) -> None:
        handle.seek(0)
        while True:
            try:
                msvcrt.locking(handle.fileno(), msvcrt.LK_LOCK, 1)
                return
            except OSError:  # LK_LOCK gives up after ten seconds; keep waiting
                continue

    def _unlock(handle) -> None:
        handle.seek(0)
        msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def _lock(handle) -> None:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)

    def _unlock(handle) -> None:
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _held(lock: Path) -> Iterator[None]:
    """An exclusive lock on the file `lock` while the block runs (it blocks until free)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+b") as handle:
        _lock(handle)
        try:
            yield
        finally:
            _unlock(handle)


def pinned_venv(venv: Path, requirements: Sequence[str], pip_args: Sequence[str] = (),
                install_env: dict[str, str] | None = None) -> Path:
    """The interpreter of `venv`, created if missing, with `requirements` (each ``dist==version``)
    installed unless they already are (a local version tag such as ``+cpu`` is not compared).
    What it creates or installs is said on stderr. Callers in other processes wait for each other
    on ``<venv>.lock``: the venv's interpreter exists before its pip does."""
    with _held(venv.with_name(venv.name + ".lock")):
        return _made(venv, requirements, pip_args, install_env)


def _made(venv: Path, requirements: Sequence[str], pip_args: Sequence[str],
          install_env: dict[str, str] | None) -> Path:
    python = interpreter(venv)
    if not python.exists():
        print(f"creating {venv}", file=sys.stderr)
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    dists = [_dist(requirement) for requirement in requirements]
    probe = ("import importlib.metadata as m, sys; print(' '.join(f'{p}=='"
             "+ m.version(p).split('+')[0] for p in sys.argv[1:]))")
    found = subprocess.run([str(python), "-c", probe, *dists], capture_output=True, text=True,
                           check=False)
    expected = [f"{dist}=={requirement.partition('==')[2]}"
                for dist, requirement in zip(dists, requirements)]
    if found.returncode != 0 or found.stdout.split() != expected:
        print(f"installing {' '.join(requirements)} into {venv}", file=sys.stderr)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        *pip_args, *requirements], check=True,
                       env={**os.environ, **(install_env or {})})
    return python


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in SPECS:
        sys.exit(f"usage: python scripts/_bench/venvs.py {'|'.join(SPECS)}")
    print(python(SPECS[sys.argv[1]]))
