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


# docs/ is a manual of what holds today, not a log of runs (the history stays in git). The
# pages' Markdown is counted; the plots and data files under docs/benchmarks/ are not.
DOCS_LIMIT = 150_000
BENCHMARKS_LIMIT = 25_000


def _sizes() -> dict[str, int]:
    return {path.relative_to(ROOT).as_posix(): path.stat().st_size
            for path in sorted((ROOT / "docs").rglob("*.md"))}


def test_the_benchmarks_page_keeps_verdicts_not_history():
    size = _sizes()["docs/benchmarks.md"]
    assert size <= BENCHMARKS_LIMIT, (
        f"docs/benchmarks.md is {size} bytes, at most {BENCHMARKS_LIMIT}: keep the verdict "
        "tables, the command of each and the machine they ran on")


def test_the_docs_stay_within_their_size():
    sizes = _sizes()
    largest = ", ".join(f"{path} {size}" for path, size in
                        sorted(sizes.items(), key=lambda item: -item[1])[:5])
    assert sum(sizes.values()) <= DOCS_LIMIT, (
        f"docs/ holds {sum(sizes.values())} bytes of Markdown, at most {DOCS_LIMIT} "
        f"(largest: {largest})")
