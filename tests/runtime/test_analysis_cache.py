"""The analysis of an unconverted model, kept once per model file (onnx_chunk.analysis_cache).

A later start of the same files reads the plan back without onnx or onnx_ir; a changed or
replaced model or data file is analysed again. Starts that must not share this test process's
imports run in fresh interpreters.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from onnx_chunk import load
from onnx_chunk.analysis_cache import ENV, cache_folder
from onnx_chunk.graph.model_io import load_model
from onnx_chunk.passes import analyze
from tests.exports.corpus import fixtures

GRAPH_LIBRARIES = ("onnx", "onnx_ir", "onnxscript")

# Loads sys.argv[1], generates two tokens, and prints the runtime's plan and the graph
# libraries then in sys.modules.
_CHILD = """
import dataclasses, json, sys
import onnx_chunk

runtime = onnx_chunk.load(sys.argv[1])
with runtime.open_sequence() as sequence:
    tokens = sequence.generate([1, 2, 3, 4, 5], 2)
runtime.close()
print(json.dumps({"plan": repr(runtime.debug.plan), "tokens": tokens,
                  "imported": sorted({name.split(".")[0] for name in sys.modules}
                                     & {"onnx", "onnx_ir", "onnxscript"})}))
"""


def _start(folder, cache) -> dict:
    env = {**os.environ, ENV: str(cache)}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(folder)], capture_output=True,
                          text=True, timeout=300, check=False, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture
def export(tmp_path):
    """A copy of an unconverted builder export of the corpus (its files may be changed)."""
    fixture = next(fixture for fixture in fixtures() if fixture.name == "genai-llama-int4")
    return shutil.copytree(fixture.folder, tmp_path / "export")


def _entries(cache) -> list:
    return sorted(cache.glob("*.json")) if cache.exists() else []


def test_a_second_start_reads_the_plan_without_the_graph_libraries(export, tmp_path):
    cache = tmp_path / "cache"
    first = _start(export, cache)
    assert {"onnx", "onnx_ir"} <= set(first["imported"])
    assert len(_entries(cache)) == 1
    second = _start(export, cache)
    assert second["imported"] == []
    assert second["plan"] == first["plan"]
    assert second["tokens"] == first["tokens"]
    # Written whole: no temporary file is left beside the entry.
    assert [path.name for path in cache.iterdir()] == [_entries(cache)[0].name]


def test_the_kept_plan_is_the_analysis(export, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    expected = analyze(load_model(export / "model.onnx"), chunk_size=512)
    for _ in range(2):  # analysed, then read back
        runtime = load(export, chunk_size=512)
        assert runtime.debug.plan == expected
        runtime.close()
    assert len(_entries(tmp_path / "cache")) == 1


@pytest.mark.parametrize("changed", ["model.onnx", "data"])
def test_a_changed_file_is_analysed_again(export, tmp_path, changed):
    cache = tmp_path / "cache"
    _start(export, cache)
    if changed == "data":
        target = next(path for path in export.iterdir() if path.suffix == ".data")
        # The same bytes written again: a new change time, as any edit of the file gives.
        target.write_bytes(target.read_bytes())
        again = _start(export, cache)
    else:
        # Replaced by a copy (another inode): what an exporter writing a new file does.
        target = export / "model.onnx"
        shutil.copy(target, export / "replacement.onnx")
        os.replace(export / "replacement.onnx", target)
        again = _start(export, cache)
    assert {"onnx", "onnx_ir"} <= set(again["imported"])
    assert len(_entries(cache)) == 2


def test_a_damaged_entry_is_analysed_again_and_written_over(export, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(ENV, str(cache))
    runtime = load(export)
    analysed = runtime.debug.plan
    runtime.close()
    [entry] = _entries(cache)
    for damage in ("{not json", json.dumps({"onnx_chunk.schema_version": "1"}), "[1, 2]"):
        entry.write_text(damage)
        runtime = load(export)
        assert runtime.debug.plan == analysed
        runtime.close()
        assert entry.read_text() != damage
        assert isinstance(json.loads(entry.read_text()), dict)


def test_a_folder_that_cannot_be_written_leaves_the_analysis_in_memory(export, tmp_path,
                                                                        monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv(ENV, str(blocked / "cache"))
    runtime = load(export)
    assert runtime.debug.plan.chunk_size is not None
    runtime.close()
    assert blocked.read_text() == "not a folder"


def test_off_keeps_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, "off")
    assert cache_folder() is None
    monkeypatch.setenv(ENV, str(tmp_path))
    assert cache_folder() == tmp_path
    monkeypatch.delenv(ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform != "win32":
        assert cache_folder() == tmp_path / "xdg" / "onnx-chunk" / "analysis"
