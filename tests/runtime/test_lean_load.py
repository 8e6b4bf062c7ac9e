"""A converted model loads, generates and closes without importing onnx, onnx_ir or onnxscript.

Each case runs in a fresh interpreter, since this test process has imported them already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from onnx_chunk.cli import main
from tests.exports.corpus import fixtures

GRAPH_LIBRARIES = ("onnx", "onnx_ir", "onnxscript")

# Loads sys.argv[1] with the options named by sys.argv[2], generates through a sequence and
# the batch engine, closes, and prints the graph libraries then in sys.modules.
_CHILD = """
import dataclasses, json, sys
import onnx_chunk

options = {}
if sys.argv[2] in ("specialize", "device"):
    options["specialize"] = True
if sys.argv[2] == "device":
    from onnx_chunk.runtime.device.provider import device_for
    options["device"] = dataclasses.replace(device_for("cpu"), host_visible=False)
runtime = onnx_chunk.load(sys.argv[1], **options)
with runtime.open_sequence() as sequence:
    sequence.generate([1, 2, 3, 4, 5, 6, 7], 3)
runtime.submit([3, 4, 5], 2).result()
runtime.generate_many([[1, 2], [5, 6, 7]], 2)
runtime.close()
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules} & set(sys.argv[3:]))))
"""


def _imported(model, mode: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(model), mode, *GRAPH_LIBRARIES],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def converted(reference_model, tmp_path_factory):
    """The `tiny` reference decoder and a builder export of the corpus, converted."""
    out = tmp_path_factory.mktemp("lean")
    fixture = next(fixture for fixture in fixtures() if fixture.name == "genai-llama-fp32")
    assert main(["convert", str(reference_model()), "-o", str(out / "tiny" / "model.onnx")]) == 0
    assert main(["convert", str(fixture.folder), "-o", str(out / "genai")]) == 0
    return {"file": out / "tiny" / "model.onnx", "folder": out / "genai"}


@pytest.mark.parametrize(("model", "mode"), [
    ("file", "default"), ("folder", "default"), ("file", "specialize"),
    ("folder", "specialize"), ("file", "device"), ("folder", "device")])
def test_a_converted_model_runs_without_the_graph_libraries(converted, model, mode):
    assert _imported(converted[model], mode) == []


def test_an_unconverted_model_runs_the_passes_with_onnx_ir(reference_model):
    assert {"onnx", "onnx_ir"} <= set(_imported(reference_model(), "default"))


# Runs `onnx-chunk generate` in-process on sys.argv[1] with the rest of its arguments, then
# prints the graph libraries in sys.modules.
_CLI_CHILD = """
import json, sys
from onnx_chunk.cli import main

code = main(["generate", *sys.argv[1:-{libraries}]])
assert code == 0, code
print(json.dumps(sorted({{name.split(".")[0] for name in sys.modules}}
                        & set(sys.argv[-{libraries}:]))))
""".format(libraries=len(GRAPH_LIBRARIES))


@pytest.mark.parametrize("arguments", [
    ["--max-new-tokens", "2"], ["--max-new-tokens", "2", "--batch", "2"],
    ["--max-new-tokens", "2", "--prompt", "Hello there"]], ids=["ids", "batch", "prompt"])
def test_the_generate_command_runs_a_converted_model_without_the_graph_libraries(
        converted, tmp_path, arguments):
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3 4 5\n6 7 8\n")
    if "--prompt" not in arguments:
        arguments = [*arguments, "--ids-file", str(ids)]
    done = subprocess.run([sys.executable, "-c", _CLI_CHILD, str(converted["folder"]), *arguments,
                           *GRAPH_LIBRARIES], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
