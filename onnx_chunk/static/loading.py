"""What a static (fixed-shape) decoder is: detected by structure, opened with its decode graph.

A static decoder has every input dimension fixed, `input_ids` [1, c] and KV inputs
`past_key_values.N.*` [1, kv_heads, C, head_size], with one of two masks: an additive
floating-point mask [1, 1, c, C] (the static reference decoder, a rolling cache) or an integer
`attention_mask` [1, C] (GroupQueryAttention bound at capacity, as `fix-shapes` writes it).
Serving one takes two graphs of the same capacity: the chunk graph (rows c) and a decode graph
(rows 1). `build-model --variant static` writes them as model.onnx and decode.onnx, `fix-shapes`
as chunk.onnx and decode.onnx; a folder names its graph as `model_folder.locate_model` says.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from onnx_chunk.errors import ConfigError, ModelLoadError, ModelStructureError
from onnx_chunk.graph.data_types import data_type_name
from onnx_chunk.graph.model_file import ValueInfo, read_model_file
from onnx_chunk.graph.model_folder import locate_model
from onnx_chunk.static.graphs import CacheLayout
from onnx_chunk.static.runner import StaticRunner

DECODE_FILE = "decode.onnx"
"""The decode graph (rows 1) looked for beside a chunk graph."""


@dataclass(frozen=True)
class StaticGraphShape:
    """The fixed sizes of a static decoder and how it takes its cache."""

    mask_input: str
    rows: int
    capacity: int
    layout: CacheLayout


def _fixed_dims(value: ValueInfo) -> list[int] | None:
    shape = value.shape
    if shape is None or not all(isinstance(dim, int) for dim in shape):
        return None
    return [int(dim) for dim in shape]


def _floating(value: ValueInfo) -> bool:
    if value.elem_type is None:
        return False
    name = data_type_name(value.elem_type)
    return name.startswith(("FLOAT", "BFLOAT")) or name == "DOUBLE"


def static_shape(inputs: Iterable[ValueInfo]) -> StaticGraphShape | None:
    """The static decoder's sizes when the graph with these inputs is one, else None.

    Rules:
    1. Any input with a free (or unknown) dimension: not static.
    2. A floating-point input shaped [1, 1, c, C] is the additive mask of the rolling layout;
       the first such input is taken.
    3. Otherwise an integer `attention_mask` [1, C] with `input_ids` [1, c] (or
       `inputs_embeds` [1, c, hidden]) and every `past_key_values.*` input
       [1, kv_heads, C, head_size] is GroupQueryAttention bound at capacity (the runner says
       which of its inputs it cannot feed).
    4. Anything else is not static.
    """
    dims: dict[str, list[int]] = {}
    for value in inputs:
        fixed = _fixed_dims(value)
        if fixed is None:
            return None
        dims[value.name] = fixed
        if _floating(value) and len(fixed) == 4 and fixed[:2] == [1, 1]:
            return StaticGraphShape(value.name, fixed[2], fixed[3], CacheLayout.ROLLING)
    mask, tokens = dims.get("attention_mask"), dims.get("input_ids", dims.get("inputs_embeds"))
    pasts = [shape for name, shape in dims.items() if name.startswith("past_key_values.")]
    if mask is None or tokens is None or not pasts or len(mask) != 2 or len(tokens) < 2:
        return None
    capacity = mask[1]
    if mask[0] != 1 or tokens[0] != 1 or any(len(shape) != 4 or shape[0] != 1
                                             or shape[2] != capacity for shape in pasts):
        return None
    return StaticGraphShape("attention_mask", tokens[1], capacity, CacheLayout.BOUND)


def is_static_model(path: str | os.PathLike) -> bool:
    """Whether MODEL (a file, or a folder as `locate_model` resolves it) is a static decoder.

    Reads the graph's inputs only, never the weights; ModelLoadError when it cannot be read.
    """
    return static_shape(read_model_file(locate_model(path).onnx_path).inputs) is not None


def check_fixed_sizes(shape: StaticGraphShape, model: str | os.PathLike, *,
                      chunk_size: int | None = None, kv_capacity: int | None = None) -> None:
    """ConfigError when a chunk size or KV capacity the caller states differs from the one the
    static graph `model` is fixed at; None means not stated."""
    for option, symbol, given, fixed in (("chunk size", "c", chunk_size, shape.rows),
                                         ("KV capacity", "C", kv_capacity, shape.capacity)):
        if given is not None and given != fixed:
            raise ConfigError(
                f"{option} {symbol}={given} was asked for but the static graph "
                f"{str(model)!r} is fixed at {symbol}={fixed}; omit the option or rebuild the "
                f"graphs with {symbol}={given}")


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
    """Open a static decoder's chunk graph and decode graph for generation.

    model: the chunk graph, or a folder holding it (model.onnx or chunk.onnx, and decode.onnx).
    decode_model: the rows-1 graph; default decode.onnx beside the chunk graph.
    max_input_len: L; default the largest multiple of c below C.
    chunk_size, kv_capacity: c and C are fixed in the graphs; when given they must equal the
        graph's values (ConfigError otherwise), so a script states what it expects.
    strict: refuse (CapacityError) requests that would lose context instead of warning.
    """
    chunk = locate_model(model).onnx_path
    shape = static_shape(read_model_file(chunk).inputs)
    if shape is None:
        raise ModelStructureError(
            f"{str(chunk)!r} is not a static decoder: some input has a free dimension, or it "
            f"has neither a float mask [1, 1, c, C] nor an attention_mask [1, C] with "
            f"past_key_values [1, kv_heads, C, head_size]; run a dynamic decoder without "
            f"--static, or fix its shapes with `onnx-chunk fix-shapes`")
    check_fixed_sizes(shape, chunk, chunk_size=chunk_size, kv_capacity=kv_capacity)
    decode = Path(decode_model) if decode_model is not None else find_decode_model(chunk)
    if decode is None:
        raise ModelLoadError(
            f"no decode graph (rows 1) beside {str(chunk)!r}: expected {DECODE_FILE} in "
            f"{str(chunk.parent)!r}; build the pair with `build-model --variant static` or "
            f"`fix-shapes`, or pass --decode-model")
    return StaticRunner(chunk, decode, max_input_len=max_input_len, provider=provider,
                        device_id=device_id, strict=strict)
