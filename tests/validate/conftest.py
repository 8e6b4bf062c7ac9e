"""Validation fixtures: converted reference decoders (chunk size 8), built once per session."""

from __future__ import annotations

import pytest

from onnx_chunk.cli import main

CHUNK = 8


@pytest.fixture(scope="session")
def converted_model(reference_model, tmp_path_factory):
    """`converted_model(variant, max_variants=4)` -> a converted copy at chunk size 8."""
    built = {}

    def build(variant: str = "base", max_variants: int = 4):
        key = (variant, max_variants)
        if key not in built:
            out = tmp_path_factory.mktemp(f"converted-{variant}-{max_variants}")
            code = main(["convert", str(reference_model(variant)), "-o", str(out),
                         "--chunk-size", str(CHUNK), "--max-variants", str(max_variants)])
            assert code == 0
            built[key] = out / "model.onnx"
        return built[key]

    return build
