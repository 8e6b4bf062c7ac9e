"""Shared fixtures: reference decoders built once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _installed_package_first() -> None:
    """Test the installed onnx_chunk, not the checkout's copy of it.

    `python -m pytest` puts the checkout first on sys.path, where its `onnx_chunk` folder would
    shadow the package pip installed (and hide missing package data, as an editable install
    does); pytest's import mode `append` (pyproject.toml) keeps it last, where it still
    provides `tests` and `scripts`.
    """
    assert "onnx_chunk" not in sys.modules, "onnx_chunk was imported before the conftest"
    root = str(ROOT)
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != root]
    sys.path.append(root)


_installed_package_first()

# No test reads the analysis of an unconverted model kept by an earlier load (or by a user's
# runs): each analyses in memory, as a first start does. tests/runtime/test_analysis_cache.py
# turns the cache on for its own folder.
os.environ["ONNX_CHUNK_ANALYSIS_CACHE"] = "off"


_CORPUS = ROOT / "tests" / "fixtures" / "exports"


@pytest.fixture(autouse=True)
def _corpus_files_keep_one_name():
    """A test that leaves a second hard link to a corpus file fails here: onnx.checker and
    onnx.load refuse external data with several links, so every later test of that export
    would fail instead."""
    yield
    linked = sorted(str(path.relative_to(_CORPUS)) for path in _CORPUS.glob("*/*")
                    if path.is_file() and path.stat().st_nlink > 1)
    assert not linked, f"this test left hard links to corpus files: {', '.join(linked)}"


@pytest.fixture(scope="session")
def reference_model(tmp_path_factory):
    """Build (once per session) a `tiny` reference decoder: `reference_model(variant, **overrides)`.

    Returns the path of the `model.onnx` file; its folder holds the external data and the
    `genai_config.json`. Tests must not modify what they get; copy it first.
    """
    built: dict[tuple, Path] = {}

    def build(variant: str = "base", **overrides) -> Path:
        key = (variant, tuple(sorted(overrides.items())))
        if key not in built:
            from onnx_chunk.models import build_decoder

            out_dir = tmp_path_factory.mktemp(f"model-{variant}")
            built[key] = build_decoder(out_dir, preset="tiny", variant=variant, **overrides)
        return built[key]

    return build


@pytest.fixture(scope="session")
def peer_python() -> Path:
    """The interpreter of the peer venv: onnxruntime-genai, its CPU onnxruntime, transformers.

    `.venv-genai` at the repository root (or $ONNX_CHUNK_GENAI_VENV), created and installed on
    first use; onnxruntime-genai's onnxruntime never shares a venv with onnxruntime-gpu.
    """
    import os

    from scripts._bench import environment

    venv = Path(os.environ.get("ONNX_CHUNK_GENAI_VENV", environment.ROOT / ".venv-genai"))
    return environment.genai_python(venv)


@pytest.fixture(scope="session")
def lmeval_python() -> Path:
    """The interpreter of the lm-evaluation-harness venv: `.venv-lmeval` at the repository
    root (or $ONNX_CHUNK_LMEVAL_VENV), created and installed on first use."""
    import os

    from scripts._bench import environment

    venv = Path(os.environ.get("ONNX_CHUNK_LMEVAL_VENV", environment.ROOT / ".venv-lmeval"))
    return environment.lmeval_python(venv)
