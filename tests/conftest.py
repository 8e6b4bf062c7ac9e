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
