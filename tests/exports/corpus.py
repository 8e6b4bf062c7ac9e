"""The corpus of real exports in tests/fixtures/exports/, as MANIFEST.json lists it.

Each fixture is a folder written by a real exporter (onnxruntime-genai's model builder,
Hugging Face Optimum, torch.onnx) from a tiny random-weight model; scripts/make_export_fixtures.py
regenerates them. Tests copy a fixture before changing anything in it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "exports"
MANIFEST = ROOT / "MANIFEST.json"

GENAI = "genai"


@dataclass(frozen=True)
class Fixture:
    """One export of the corpus."""

    name: str
    layout: str
    precision: str
    model_type: str
    features: dict

    @property
    def folder(self) -> Path:
        return ROOT / self.name

    @property
    def grouped_query_attention(self) -> bool:
        """Whether the decoder attends with com.microsoft::GroupQueryAttention (KV at capacity)."""
        graph = onnx.load(str(self.folder / "model.onnx"), load_external_data=False).graph
        return any(node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft"
                   for node in graph.node)

    def copy_to(self, target: Path) -> Path:
        """A private copy of the fixture's folder; returns the copy's folder."""
        shutil.copytree(self.folder, target)
        return target

    def __str__(self) -> str:
        return self.name


def builder_gqa_fixtures() -> list[Fixture]:
    """The builder's exports that attend with GroupQueryAttention: what both runtimes serve.

    (The builder's fp16 CPU export attends with MultiHeadAttention over a concatenated KV,
    which neither runtime serves; see test_commands.)
    """
    return [fixture for fixture in fixtures(GENAI) if fixture.grouped_query_attention]


def fixtures(layout: str | None = None) -> list[Fixture]:
    """The corpus's fixtures, of one layout when given, in manifest order."""
    manifest = json.loads(MANIFEST.read_text())
    found = [Fixture(name=entry["name"], layout=entry["layout"], precision=entry["precision"],
                     model_type=entry["model_type"], features=entry.get("features", {}))
             for entry in manifest["fixtures"]]
    return [fixture for fixture in found if layout is None or fixture.layout == layout]
