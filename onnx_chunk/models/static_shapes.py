"""Fixing a dynamic decoder's free dimensions: a chunk graph (rows c) and a decode graph (rows 1).

Accelerators that cannot take dynamic shapes need every dimension fixed at export time. This
applies ONNX Runtime's own tools (`onnxruntime.tools.onnx_model_utils.make_dim_param_fixed`, then
`fix_output_shapes` for outputs shape inference can now resolve) twice to the same graph:
once with the query rows set to c and once with rows 1. The roles of the dim_params are found by
structure, not by name: batch and rows from `input_ids` (or `inputs_embeds`), the KV capacity
from dim 2 of `past_key_values.*` and the last dim of a 2-D `attention_mask`.

Weights are never loaded; their files are checked by `model_io.load_model` (inside the model's
folder, present, long enough). Both graphs keep pointing at the same external data files, which
are copied once next to them under the same relative names. Everything is staged in a temporary
folder inside the output folder and renamed into place at the end.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnxruntime.tools.onnx_model_utils import fix_output_shapes, make_dim_param_fixed

from onnx_chunk.errors import ConfigError, ModelStructureError, OutputError
from onnx_chunk.model_io import external_data_files, load_model
from onnx_chunk.models.static_decoder import DECODE_FILE

logger = logging.getLogger(__name__)

CHUNK_MODEL = "chunk.onnx"
DECODE_MODEL = DECODE_FILE


@dataclass
class FixedShapes:
    """What `fix_shapes` wrote."""

    chunk_model: Path
    decode_model: Path
    chunk_dims: dict[str, int]
    """dim_param -> value in the chunk graph (the decode graph differs only in the rows)."""
    data_files: list[Path] = field(default_factory=list)
    """External data files shared by both graphs."""
    free_outputs: list[str] = field(default_factory=list)
    """Outputs whose shape still has a free dimension (nothing could infer it)."""


def _dims(value: onnx.ValueInfoProto) -> list[onnx.TensorShapeProto.Dimension]:
    return list(value.type.tensor_type.shape.dim)


def _free_dims(values) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for value in values:
        params = [dim.dim_param for dim in _dims(value) if not dim.HasField("dim_value")]
        if params:
            found[value.name] = [param or "?" for param in params]
    return found


def _role_dims(graph: onnx.GraphProto) -> tuple[str | None, str | None, set[str]]:
    """(batch dim_param, rows dim_param, capacity dim_params) found by structure."""
    inputs = {value.name: value for value in graph.input}
    token_input = inputs.get("input_ids") or inputs.get("inputs_embeds")
    if token_input is None or len(_dims(token_input)) < 2:
        raise ModelStructureError(
            f"found no input_ids [batch, rows] (or inputs_embeds) input; inputs are "
            f"{', '.join(inputs) or 'none'}; fix-shapes needs a decoder with a token input"
        )
    batch_dim, rows_dim = _dims(token_input)[:2]
    capacity: set[str] = set()
    for name, value in inputs.items():
        dims = _dims(value)
        if name.startswith("past_key_values.") and len(dims) == 4:
            capacity.add(dims[2].dim_param)
        if name == "attention_mask" and len(dims) == 2:
            capacity.add(dims[1].dim_param)
    capacity.discard("")
    return batch_dim.dim_param or None, rows_dim.dim_param or None, capacity


def _fix_output_shapes(model: onnx.ModelProto) -> None:
    """fix_output_shapes on a stand-in whose external initializers are graph inputs of the
    same type and shape (its checker would otherwise look for the data relative to the working
    directory); the outputs it fixes are copied back."""
    stand_in = copy.deepcopy(model)
    external = [tensor for tensor in stand_in.graph.initializer
                if tensor.data_location == onnx.TensorProto.EXTERNAL]
    for tensor in external:
        stand_in.graph.initializer.remove(tensor)
        stand_in.graph.input.append(
            onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    fix_output_shapes(stand_in)
    for output, fixed in zip(model.graph.output, stand_in.graph.output):
        output.type.CopyFrom(fixed.type)


def _fixed_copy(model: onnx.ModelProto, values: Mapping[str, int]) -> onnx.ModelProto:
    fixed = copy.deepcopy(model)
    for param, value in values.items():
        make_dim_param_fixed(fixed.graph, param, value)
    _fix_output_shapes(fixed)
    return fixed


def _write_outputs(out: Path, data_files: Mapping[str, Path], chunk: onnx.ModelProto,
                   decode: onnx.ModelProto) -> list[Path]:
    """Stage the data files and both graphs in a temporary folder inside `out`, then rename
    them into place (data first, graphs last): a failure leaves nothing half written."""
    written = []
    with tempfile.TemporaryDirectory(dir=out, prefix=".tmp-") as scratch:
        staged = Path(scratch)
        moves = []
        for location, source in data_files.items():
            target = out / location
            if target.exists() and os.path.samefile(source, target):
                written.append(target)
                continue
            (staged / location).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, staged / location)
            moves.append((staged / location, target))
            written.append(target)
        for model, name in ((chunk, CHUNK_MODEL), (decode, DECODE_MODEL)):
            (staged / name).write_bytes(model.SerializeToString())
            moves.append((staged / name, out / name))
        for source, target in moves:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)
    return written


def fix_shapes(
    model_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    rows: int,
    capacity: int | None = None,
    dims: Mapping[str, int] | None = None,
) -> FixedShapes:
    """Write `out_dir/chunk.onnx` (rows = `rows`) and `out_dir/decode.onnx` (rows = 1).

    Rules:
    1. The batch dim_param becomes 1, the rows dim_param `rows` (1 in the decode graph), the
       capacity dim_params `capacity`; `dims` sets any other dim_param by name (and wins).
    2. A capacity dim that is still free and no `capacity` given is a ConfigError; so are
       rows < 2 (rows 1 is the decode graph) and non-positive values.
    3. Any graph input left with a free dimension is a ModelStructureError naming it, to be
       fixed with `dims`; outputs nothing can infer stay free and are reported.
    4. External data must sit inside the model's folder, present and long enough
       (ModelLoadError otherwise); it is copied once into `out_dir` under its relative names
       and shared by both graphs; the source model is never modified.
    5. Nothing appears in `out_dir` unless everything was written (OutputError otherwise).
    """
    source = Path(model_path)
    if rows < 2:
        raise ConfigError(f"--rows must be at least 2 (rows 1 is the decode graph), got {rows}")
    if capacity is not None and capacity < rows:
        raise ConfigError(f"capacity {capacity} is smaller than rows {rows}; use C >= rows")
    extra = dict(dims or {})
    bad = {name: value for name, value in extra.items() if value < 1}
    if bad:
        raise ConfigError(f"dimension values must be at least 1, got {bad}")
    # load_model checks the external data (inside the model's folder, present, long enough).
    data_files = external_data_files(load_model(source))
    model = onnx.load(source, load_external_data=False)

    batch, rows_param, capacity_params = _role_dims(model.graph)
    if capacity_params and capacity is None and not capacity_params <= set(extra):
        raise ConfigError(
            f"the KV capacity dimension(s) {', '.join(sorted(capacity_params))} are free; pass "
            f"--capacity C (C = max prompt length + max new tokens)"
        )
    values: dict[str, int] = {}
    if batch:
        values[batch] = 1
    values.update({param: capacity for param in capacity_params if capacity is not None})
    if rows_param in values:
        raise ModelStructureError(
            f"the rows dimension {rows_param!r} is also used as a batch or capacity dimension; "
            f"fix them by hand with --dim NAME=VALUE"
        )
    chunk_values = {**values, **({rows_param: rows} if rows_param else {}), **extra}
    decode_values = {**values, **({rows_param: 1} if rows_param else {}), **extra}
    try:
        chunk = _fixed_copy(model, chunk_values)
        decode = _fixed_copy(model, decode_values)
    except onnx.checker.ValidationError as error:
        raise ModelStructureError(f"{source} fails ONNX's checker after fixing shapes: {error}") \
            from error
    free_inputs = _free_dims(chunk.graph.input)
    if free_inputs:
        listed = "; ".join(f"{name}: {', '.join(params)}" for name, params in free_inputs.items())
        raise ModelStructureError(
            f"inputs still have free dimensions after fixing ({listed}); set each with "
            f"--dim NAME=VALUE"
        )
    free_outputs = sorted(_free_dims(chunk.graph.output))
    if free_outputs:
        logger.warning("outputs %s keep free dimensions that shape inference cannot resolve",
                       ", ".join(free_outputs))

    out = Path(out_dir)
    chunk_path, decode_path = out / CHUNK_MODEL, out / DECODE_MODEL
    try:
        out.mkdir(parents=True, exist_ok=True)
        written = _write_outputs(out, data_files, chunk, decode)
    except OSError as error:
        raise OutputError(f"cannot write into {out}: {error}; choose a writable folder") \
            from error
    logger.info("fixed %s: %s (rows %d) and %s (rows 1), dims %s", source, chunk_path, rows,
                decode_path, chunk_values)
    return FixedShapes(chunk_path, decode_path, chunk_values, written, free_outputs)
