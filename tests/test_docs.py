"""The repository names no path of one machine, and docs/ stays a manual a newcomer can read."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Absolute folders of one machine (spelled in parts so that this file does not hold them).
_MACHINE_PATH = re.compile(rb"/" + rb"(?:work|root|home/[a-z_][\w.-]*|Users/[\w.-]+)/")


def test_no_file_names_a_folder_of_one_machine():
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in ("onnx_chunk", "scripts", "tests", "docs"):
        files += sorted(path for path in (ROOT / folder).rglob("*")
                        if path.is_file() and "__pycache__" not in path.parts)
    found = [f"{path.relative_to(ROOT)}: {match.group().decode()}"
             for path in files for match in [_MACHINE_PATH.search(path.read_bytes())] if match]
    assert not found, "\n".join(found)
