"""The offline passes and `onnx-chunk convert` never import the runtime, and import ONNX Runtime
only to read GroupQueryAttention's schema (`--native-chunks auto|on`); with `off`, not at all."""

import json
import subprocess
import sys

import pytest

from onnx_chunk.graph.model_io import save_model

# Imports every module of onnx_chunk.passes and the ladder, converts argv[1] into argv[2] with
# --native-chunks argv[3], and prints as its last line the ONNX Runtime and onnx_chunk.runtime
# modules that got imported.
_CHILD = """
import importlib, json, pkgutil, sys
import onnx_chunk.ladder, onnx_chunk.passes
for module in pkgutil.iter_modules(onnx_chunk.passes.__path__):
    importlib.import_module(f"onnx_chunk.passes.{module.name}")
from onnx_chunk.cli import main
code = main(["convert", sys.argv[1], "-o", sys.argv[2], "--native-chunks", sys.argv[3]])
print(json.dumps(sorted({name.split(".")[0] if name.startswith("onnxruntime") else name
                         for name in sys.modules
                         if name.split(".")[0] == "onnxruntime"
                         or name.startswith("onnx_chunk.runtime")})))
sys.exit(code)
"""


@pytest.mark.parametrize(("native_chunks", "imported"), [("off", []), ("auto", ["onnxruntime"])])
def test_the_passes_and_convert_never_import_the_runtime(make_decoder, tmp_path, native_chunks,
                                                          imported):
    source = tmp_path / "in" / "model.onnx"
    save_model(make_decoder(), source)
    child = subprocess.run([sys.executable, "-c", _CHILD, str(source), str(tmp_path / "out"),
                            native_chunks], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert (tmp_path / "out" / "model.onnx").is_file()
    assert json.loads(child.stdout.splitlines()[-1]) == imported
