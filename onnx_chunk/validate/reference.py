"""The whole-prompt reference graph: the decoder with its LM head applied to the last row only.

A whole-prompt forward of L rows makes [L, vocab] logits inside ONNX Runtime (726 MB for 1195
rows of a 151936-token vocabulary in float32), more than serving ever holds (it prefills W rows
at a time). The reference forwards compare only last rows (each chunk boundary's row comes
from a whole forward of that prefix), so they run on a copy of the graph whose LM head sees
the last row alone: its logits are [batch, 1, vocab] and the runtime treats it as a decoder
with last-row logits.

Rules of `last_row_graph`:
1. The LM head is the MatMul-like node (MatMul, MatMulNBits, FusedMatMul, Gemm) reached from
   the `logits` output through elementwise nodes whose other inputs are constants (a Cast, a
   bias Add, a softcap's Div, Tanh and Mul). Its activation input gets a Slice of the last
   row on axis 1, and the `logits` output's row dimension becomes 1.
2. A decoder whose logits already keep one row, or whose LM head is not found that way, is
   used as it is (None).
3. The copy is a folder of its own: the edited graph and a hard link to every other file of
   the model's folder (external data, genai_config.json, embeddings.npy; a symbolic link to a
   folder), so no weight is copied and the original folder is never written. Where the folder
   cannot hold a hard link (another file system), the edited graph is written beside the
   model under a hidden temporary name instead, and the caller removes it; where that fails
   too (a read-only folder), OSError.
4. The folder (`reference_folder`) is named after the process and removed when the reference
   runs end; one left behind by a process that no longer runs (killed mid-run) is removed by
   the next validation before it reads the model, so no stale hard link of the weights
   outlives it (onnx.checker refuses external data with several links).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx
from onnx import TensorProto, helper

logger = logging.getLogger(__name__)

_HEADS = {"MatMul", "MatMulNBits", "FusedMatMul", "Gemm"}
_ELEMENTWISE = {"Cast", "Add", "Sub", "Mul", "Div", "Tanh", "Identity"}
_LOGITS = "logits"


_PREFIX = "onnx-chunk-validate-"


@contextlib.contextmanager
def reference_folder() -> Iterator[Path]:
    """An empty temporary folder for the reference copy, removed on exit (rule 4)."""
    remove_stale_reference_folders()
    with tempfile.TemporaryDirectory(prefix=f"{_PREFIX}{os.getpid()}-") as folder:
        yield Path(folder)


def remove_stale_reference_folders() -> None:
    """Remove the reference folders of validations that no longer run (rule 4); validate
    calls it before its structure checks too."""
    _remove_stale(Path(tempfile.gettempdir()))


def _remove_stale(root: Path) -> None:
    for entry in root.glob(f"{_PREFIX}*-*"):
        pid = entry.name[len(_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            logger.info("removing %s, left by process %s", entry, pid)
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def last_row_graph(model_path: Path, folder: Path) -> Path | None:
    """Write the last-row reference copy of `model_path` into the empty `folder` (or, when its
    weights cannot be linked there, beside the model); return the copy's model path, or None
    when the decoder is used as it is (rules 2 and 4)."""
    proto = onnx.load(str(model_path), load_external_data=False)
    if not _edit(proto.graph):
        return None
    data = proto.SerializeToString()
    try:
        for entry in model_path.parent.iterdir():
            if entry.name == model_path.name:
                continue
            if entry.is_file():
                os.link(entry, folder / entry.name)
            else:
                os.symlink(entry.resolve(), folder / entry.name)
        target = folder / model_path.name
        target.write_bytes(data)
        return target
    except OSError as error:
        logger.info("cannot link the weights into %s (%s); writing the reference graph beside "
                    "the model", folder, error)
    handle, name = tempfile.mkstemp(prefix=".onnx-chunk-validate-", suffix=".onnx",
                                    dir=model_path.parent)
    with os.fdopen(handle, "wb") as file:
        file.write(data)
    return Path(name)


def _edit(graph: onnx.GraphProto) -> bool:
    output = next((value for value in graph.output if value.name == _LOGITS), None)
    if output is None:
        return False
    dims = output.type.tensor_type.shape.dim
    if len(dims) != 3 or (dims[1].HasField("dim_value") and dims[1].dim_value == 1):
        return False
    constants = {tensor.name for tensor in graph.initializer}
    constants |= {out for node in graph.node if node.op_type == "Constant" for out in node.output}
    producers = {out: node for node in graph.node for out in node.output}
    node = producers.get(_LOGITS)
    while node is not None and node.op_type in _ELEMENTWISE:
        varying = [name for name in node.input if name and name not in constants]
        if len(varying) != 1:
            return False
        node = producers.get(varying[0])
    if node is None or node.op_type not in _HEADS:
        logger.info("no LM head found before the logits; the reference computes every row")
        return False
    rows = node.input[0]
    last = f"{rows}/validate_last_row"
    bounds = [helper.make_tensor(f"{last}/{name}", TensorProto.INT64, [1], [value])
              for name, value in (("starts", -1), ("ends", 2**62), ("axes", 1))]
    graph.initializer.extend(bounds)
    node.input[0] = last
    nodes = list(graph.node)
    # Just before the head, whose input is produced earlier: the graph stays sorted.
    nodes.insert(nodes.index(node), helper.make_node(
        "Slice", [rows] + [bound.name for bound in bounds], [last], name="validate_last_row"))
    del graph.node[:]
    graph.node.extend(nodes)
    dims[1].Clear()
    dims[1].dim_value = 1
    for info in graph.value_info:
        if info.name == _LOGITS:
            graph.value_info.remove(info)
            break
    return True

