"""Every `--json` output carries `"schema": 1` as its first key (docs/json.md)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from onnx_chunk.cli import main
from onnx_chunk.cli.json_output import SCHEMA
from tests.cli_output import validate_passes

CLI = Path(main.__code__.co_filename).parent
LLAMA = Path(__file__).resolve().parent.parent / "fixtures" / "exports" / "genai-llama-fp32"


def _objects(text: str) -> list[dict]:
    text = text.strip()
    if text.startswith("{\n"):
        return [json.loads(text)]
    return [json.loads(line) for line in text.splitlines()]


def _schema_first(objects: list[dict]) -> None:
    assert objects
    for entry in objects:
        assert next(iter(entry)) == "schema" and entry["schema"] == SCHEMA == 1, entry


def test_generate_inspect_and_validate_json_carry_the_schema(reference_model, capsys):
    model = reference_model()
    capsys.readouterr()
    assert main(["generate", str(model), "--random-prompt", "9", "--max-new-tokens", "2",
                 "--json"]) == 0
    _schema_first(_objects(capsys.readouterr().out))
    assert main(["generate", str(model), "--random-prompt", "9", "--max-new-tokens", "2",
                 "--batch", "2", "--json"]) == 0
    _schema_first(_objects(capsys.readouterr().out))
    assert main(["inspect", str(model), "--json"]) == 0
    _schema_first(_objects(capsys.readouterr().out))
    report = validate_passes(capsys, model, "5")
    assert next(iter(report)) == "schema" and report["schema"] == 1


def test_text_generate_json_carries_the_schema(capsys):
    assert main(["generate", str(LLAMA), "--prompt", "Hello", "--max-new-tokens", "2",
                 "--json"]) == 0
    _schema_first(_objects(capsys.readouterr().out))


def test_no_command_prints_json_without_the_schema():
    """Every JSON a command prints goes through json_output.dumps."""
    for path in sorted(CLI.glob("*.py")):
        if path.name == "json_output.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "dumps" \
                    and isinstance(node.value, ast.Name) and node.value.id == "json":
                raise AssertionError(f"{path.name}:{node.lineno} prints json.dumps directly")

