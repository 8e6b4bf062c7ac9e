"""Shared fixtures: reference decoders built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


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
