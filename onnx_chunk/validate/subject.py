"""The model under validation: its file, its graph without weights, and what kind it is.

A model whose protobuf cannot be read is a ModelLoadError (exit code 2). A model whose
protobuf reads but whose external data is broken is still validated: the external data check
fails with the loader's reason, and the graph is analysed from the protobuf alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir

from onnx_chunk.errors import ModelLoadError
from onnx_chunk.graph.model_file import ValueInfo
from onnx_chunk.graph.model_folder import check_utf8_path, locate_model
from onnx_chunk.graph.model_io import load_model
from onnx_chunk.static.loading import StaticGraphShape, static_shape


@dataclass
class Subject:
    """A model file and its graph; `external_data_error` is None when the weights are sound."""

    path: Path
    model: ir.Model
    external_data_error: str | None
    static: StaticGraphShape | None


def load_subject(path: str | os.PathLike) -> Subject:
    """Load MODEL's graph (never its weights) and classify it; ModelLoadError when unreadable."""
    model_path = locate_model(path).onnx_path
    check_utf8_path(model_path)
    try:
        model = load_model(model_path, check_graph=False)  # structure.checker reports it
        external_error = None
    except ModelLoadError as error:
        model = _graph_only(model_path, error)
        external_error = str(error)
    return Subject(model_path, model, external_error, static_shape(_inputs(model)))


def _inputs(model: ir.Model) -> list[ValueInfo]:
    """The graph's inputs as the static detection reads them from a file."""
    return [ValueInfo(value.name, None if value.dtype is None else int(value.dtype),
                      None if value.shape is None
                      else tuple(dim if isinstance(dim, int) else None for dim in value.shape.dims))
            for value in model.graph.inputs]


def _graph_only(model_path: Path, load_error: ModelLoadError) -> ir.Model:
    """The graph of a model whose protobuf reads although its external data does not."""
    try:
        proto = onnx.load(str(model_path), load_external_data=False)
    except Exception as error:  # the loader's own error says what is wrong with the file
        raise load_error from error
    if proto.ir_version == 0 or not proto.HasField("graph"):
        raise load_error
    try:
        return ir.serde.deserialize_model(proto)
    except Exception as error:  # onnx_ir wraps every deserialisation failure differently
        raise load_error from error
