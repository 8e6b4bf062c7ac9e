"""What a static (fixed-shape) decoder is: detected by structure, opened with its decode graph.

A static decoder has every input dimension fixed and an additive floating-point attention mask
shaped [1, 1, c, C] (c query rows, C KV capacity). Serving one takes two graphs of the same
capacity: the chunk graph (rows c) and a decode graph (rows 1). `build-model --variant static`
writes them as model.onnx and decode.onnx, `fix-shapes` as chunk.onnx and decode.onnx; both
layouts are found here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir

from onnx_chunk.errors import ConfigError, ModelLoadError, ModelStructureError
from onnx_chunk.model_io import load_model
from onnx_chunk.models.static_decoder import DECODE_FILE, MODEL_FILE
from onnx_chunk.runtime.static_runner import StaticRunner

CHUNK_FILES = (MODEL_FILE, "chunk.onnx")


@dataclass(frozen=True)
class StaticGraphShape:
    """The fixed sizes read off a static decoder's additive mask [1, 1, c, C]."""

    mask_input: str
    rows: int
    capacity: int


def static_shape(model: ir.Model) -> StaticGraphShape | None:
    """The static decoder's sizes when the graph is one, else None.

    Rules:
    1. Any input with a free (or unknown) dimension: not static.
    2. Static needs a floating-point input shaped [1, 1, c, C]: the additive mask; the first
       such input is taken.
    """
    mask = None
    for value in model.graph.inputs:
        shape = value.shape
        if shape is None or not all(isinstance(dim, int) for dim in shape.dims):
            return None
        dtype = value.dtype
        if (mask is None and dtype is not None and dtype.is_floating_point()
                and len(shape) == 4 and tuple(shape.dims[:2]) == (1, 1)):
            mask = StaticGraphShape(value.name, int(shape[2]), int(shape[3]))
    return mask


def chunk_model_file(path: str | os.PathLike) -> Path:
    """The chunk graph MODEL names: the file itself, or model.onnx / chunk.onnx in a folder."""
    given = Path(path)
    if not given.is_dir():
        return given
    for name in CHUNK_FILES:
        if (given / name).is_file():
            return given / name
    raise ModelLoadError(
        f"the folder {str(given)!r} holds neither {' nor '.join(CHUNK_FILES)}; pass the static "
        f"chunk graph's .onnx file")


def is_static_model(path: str | os.PathLike) -> bool:
    """Whether MODEL (a file, or a folder with model.onnx / chunk.onnx) is a static decoder.

    Reads the graph only, never the weights; ModelLoadError when it cannot be read.
    """
    return static_shape(load_model(chunk_model_file(path))) is not None


def find_decode_model(chunk_model: str | os.PathLike) -> Path | None:
    """The decode graph (rows 1) beside a chunk graph: decode.onnx in the same folder, which is
    where both `build-model --variant static` and `fix-shapes` put it; None when absent."""
    chunk = Path(chunk_model)
    sibling = chunk.parent / DECODE_FILE
    if sibling.is_file() and sibling.resolve() != chunk.resolve():
        return sibling
    return None


def load_static(
    model: str | os.PathLike,
    *,
    decode_model: str | os.PathLike | None = None,
    max_input_len: int | None = None,
    chunk_size: int | None = None,
    kv_capacity: int | None = None,
    provider: str = "auto",
    device_id: int = 0,
    strict: bool = False,
) -> StaticRunner:
    """Open a static decoder's chunk graph and decode graph for greedy generation.

    model: the chunk graph, or a folder holding model.onnx or chunk.onnx (and decode.onnx).
    decode_model: the rows-1 graph; default decode.onnx beside the chunk graph.
    max_input_len: L; default the largest multiple of c below C.
    chunk_size, kv_capacity: c and C are fixed in the graphs; when given they must equal the
        graph's values (ConfigError otherwise), so a script states what it expects.
    strict: refuse (CapacityError) requests that would lose context instead of warning.
    """
    chunk = chunk_model_file(model)
    shape = static_shape(load_model(chunk))
    if shape is None:
        raise ModelStructureError(
            f"{str(chunk)!r} is not a static decoder: some input has a free dimension or no "
            f"float input is shaped [1, 1, c, C] (the additive mask); run a dynamic decoder "
            f"without --static, or fix its shapes with `onnx-chunk fix-shapes`")
    for option, symbol, given, fixed in (("chunk size", "c", chunk_size, shape.rows),
                                         ("KV capacity", "C", kv_capacity, shape.capacity)):
        if given is not None and given != fixed:
            raise ConfigError(
                f"{option} {symbol}={given} was asked for but the static graph {str(chunk)!r} "
                f"is fixed at {symbol}={fixed}; omit the option or rebuild the graphs with "
                f"{symbol}={given}")
    decode = Path(decode_model) if decode_model is not None else find_decode_model(chunk)
    if decode is None:
        raise ModelLoadError(
            f"no decode graph (rows 1) beside {str(chunk)!r}: expected {DECODE_FILE} in "
            f"{str(chunk.parent)!r}; build the pair with `build-model --variant static` or "
            f"`fix-shapes`, or pass --decode-model")
    return StaticRunner(chunk, decode, max_input_len=max_input_len, provider=provider,
                        device_id=device_id, strict=strict)
