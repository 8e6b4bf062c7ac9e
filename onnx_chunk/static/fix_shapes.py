"""Fixing a dynamic decoder's free dimensions: a chunk graph (rows c) and a decode graph (rows 1).

Accelerators that cannot take dynamic shapes need every dimension fixed at export time. This
applies ONNX Runtime's own tools (`onnxruntime.tools.onnx_model_utils.make_dim_param_fixed`, then
`fix_output_shapes` for outputs shape inference can now resolve) twice to the same graph:
once with the query rows set to c and once with rows 1. The roles of the dim_params are found by
structure, not by name: batch and rows from `input_ids` (or `inputs_embeds`), the KV capacity
from dim 2 of `past_key_values.*` and the last dim of a 2-D `attention_mask`.

Weights are never loaded; their files are checked by `model_io.load_model` (inside the model's
folder, present, long enough). Both graphs keep pointing at the same external data files, which
are copied once next to them under the same relative names. Both graphs record a digest of the
model they were fixed from (`source_digest`: its graph and its weights, no path, so the output is
the same bytes on every machine), so a later run writes over its own earlier output but never
over another model's files or over its input. Everything is staged in a temporary folder inside
the output folder and renamed into place at the end.

A decoder with recurrent or conv state is refused: fixed-row chunks padded on the right would
fold their padding into the state. A window-sized KV cache (GroupQueryAttention
`sliding_window_cache=1`) is fixed at the capacity C like the others: it evicts only once more
than C positions were written (`runtime.kv_window.resident_rows`), and the bound layout never
writes past C, so its padded rows are overwritten as in a full cache.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir
from onnxruntime.tools.onnx_model_utils import fix_output_shapes, make_dim_param_fixed

from onnx_chunk.errors import ConfigError, ModelLoadError, ModelStructureError, OutputError
from onnx_chunk.graph.chunk_plan import KVCapacityFindings, check_window_capacity
from onnx_chunk.graph.external_data import external_data_files
from onnx_chunk.graph.model_io import load_model
from onnx_chunk.ort_schemas import register_runtime_schemas
from onnx_chunk.passes.kv_capacity import find_kv_capacity
from onnx_chunk.passes.recurrent_state import find_recurrent_state
from onnx_chunk.staged_output import Staging, staged_write
from onnx_chunk.static.loading import DECODE_FILE

logger = logging.getLogger(__name__)

CHUNK_MODEL = "chunk.onnx"
DECODE_MODEL = DECODE_FILE
SOURCE_KEY = "onnx_chunk.fix_shapes.source"
"""metadata_props key of both graphs: `source_digest` of the model they were fixed from."""
_DIGEST_BLOCK = 1 << 20


@dataclass
class FixedShapes:
    """What `fix_shapes` wrote."""

    chunk_model: Path
    decode_model: Path
    chunk_rows: int
    """Query rows of the written chunk graph, read back from it."""
    decode_rows: int
    """Query rows of the written decode graph, read back from it (1)."""
    capacity: int | None
    """KV capacity C of the written graphs, read back from the chunk graph (None without KV
    inputs)."""
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


def _token_input(graph: onnx.GraphProto) -> onnx.ValueInfoProto:
    inputs = {value.name: value for value in graph.input}
    token_input = inputs.get("input_ids") or inputs.get("inputs_embeds")
    if token_input is None or len(_dims(token_input)) < 2:
        raise ModelStructureError(
            f"found no input_ids [batch, rows] (or inputs_embeds) input; inputs are "
            f"{', '.join(inputs) or 'none'}; fix-shapes needs a decoder with a token input"
        )
    return token_input


def _role_dims(graph: onnx.GraphProto) -> tuple[str | None, str | None, set[str]]:
    """(batch dim_param, rows dim_param, capacity dim_params) found by structure."""
    inputs = {value.name: value for value in graph.input}
    batch_dim, rows_dim = _dims(_token_input(graph))[:2]
    capacity: set[str] = set()
    for name, value in inputs.items():
        dims = _dims(value)
        if name.startswith("past_key_values.") and len(dims) == 4:
            capacity.add(dims[2].dim_param)
        if name == "attention_mask" and len(dims) == 2:
            capacity.add(dims[1].dim_param)
    capacity.discard("")
    return batch_dim.dim_param or None, rows_dim.dim_param or None, capacity


def _present_capacity_dims(graph: onnx.GraphProto, kv: KVCapacityFindings) -> set[str]:
    """The dim_params of the GQA present outputs' capacity axes: bound at capacity, each is
    its past's buffer, C positions (a window-sized cache names its own, `total_sliding_length`)."""
    outputs = {value.name: _dims(value) for value in graph.output}
    found = set()
    for binding in kv.bindings:
        dims = outputs.get(binding.output, [])
        if len(dims) > binding.capacity_axis and dims[binding.capacity_axis].dim_param:
            found.add(dims[binding.capacity_axis].dim_param)
    return found


def _written_sizes(path: Path) -> tuple[int, int | None]:
    """(query rows, KV capacity) of a written graph, read from its token input and dim 2 of
    its first past_key_values input (None without one)."""
    graph = onnx.load(path, load_external_data=False).graph
    rows = _dims(_token_input(graph))[1]
    pasts = [_dims(value) for value in graph.input
             if value.name.startswith("past_key_values.") and len(_dims(value)) == 4]
    return rows.dim_value, pasts[0][2].dim_value if pasts else None


def _written_from(path: Path) -> str | None:
    """The source a graph in the output folder records; None for any other file."""
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:  # onnx raises its own untyped errors: not a graph fix-shapes wrote
        return None
    return {prop.key: prop.value for prop in model.metadata_props}.get(SOURCE_KEY)


def source_digest(model: onnx.ModelProto, data_files: Mapping[str, Path],
                  progress: Callable[[int], None] | None = None) -> str:
    """"sha256:" + the hex sha256 of the serialized graph, then of each external data file's
    relative name, size and bytes (in name order): what identifies a source model without its
    path. Fine-tunes of one architecture share their graph bytes and data sizes, so the weights'
    bytes are hashed too (read once more, block by block; the copy reads them anyway)."""
    digest = hashlib.sha256(model.SerializeToString(deterministic=True))
    for location in sorted(data_files):
        path = data_files[location]
        digest.update(f"\0{location}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as data:
            while block := data.read(_DIGEST_BLOCK):
                digest.update(block)
                if progress is not None:
                    progress(len(block))
    return "sha256:" + digest.hexdigest()


def _check_targets(source: Path, digest: str, out: Path, data_files: Mapping[str, Path]
                   ) -> None:
    """Refuse (OutputError) to write over the input, or over files of another model.

    Rules:
    1. chunk.onnx or decode.onnx in `out` that is the input file itself: refused.
    2. An existing chunk.onnx or decode.onnx that does not record `digest` (fixed from
       another model, or written by something else): refused.
    3. An existing data file under a copied name that is not the input's own data file is
       refused unless an existing graph of `out` records `digest` (then it is this model's
       earlier output, and it is replaced).
    """
    graphs = [out / CHUNK_MODEL, out / DECODE_MODEL]
    ours = False
    for target in graphs:
        if not target.exists():
            continue
        if os.path.samefile(target, source):
            raise OutputError(
                f"{target} is the input model itself; write the fixed graphs into another "
                f"folder (-o)")
        if _written_from(target) != digest:
            raise OutputError(
                f"{target} already exists and was not fixed from {source}; choose an empty "
                f"folder (-o) or remove it")
        ours = True
    for location, data in data_files.items():
        target = out / location
        if target.exists() and not os.path.samefile(target, data) and not ours:
            raise OutputError(
                f"{target} already exists and belongs to another model; choose an empty "
                f"folder (-o) or remove it")


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
    register_runtime_schemas()  # its checker must know the builder's default-domain ops
    fix_output_shapes(stand_in)
    for output, fixed in zip(model.graph.output, stand_in.graph.output):
        output.type.CopyFrom(fixed.type)


def _head_dims(model: ir.Model, kv: KVCapacityFindings) -> dict[str, int]:
    """The free head axes of the KV inputs (builder exports: `kv_cache_dim`), sized as the KV
    capacity pass resolved them from the graph; a name sized two ways is left to --dim."""
    inputs = {value.name: value for value in model.graph.inputs}
    sizes: dict[str, set[int]] = {}
    for binding in kv.bindings:
        shape = inputs[binding.input].shape
        for axis, size in ((1, binding.kv_heads), (3, binding.head_size)):
            dim = shape[axis] if shape is not None and len(shape) > axis else None
            if size is not None and isinstance(dim, ir.SymbolicDim) and dim.value:
                sizes.setdefault(dim.value, set()).add(size)
    return {name: values.pop() for name, values in sizes.items() if len(values) == 1}


def _fixed_copy(model: onnx.ModelProto, values: Mapping[str, int]) -> onnx.ModelProto:
    fixed = copy.deepcopy(model)
    for param, value in values.items():
        make_dim_param_fixed(fixed.graph, param, value)
    _fix_output_shapes(fixed)
    return fixed


def _write_outputs(staging: Staging, data_files: Mapping[str, Path], chunk: onnx.ModelProto,
                   decode: onnx.ModelProto, progress: Callable[[int], None] | None
                   ) -> list[Path]:
    """Stage the data files (with their permission bits) and both graphs, then publish them
    (data first, graphs last); return the data files' paths in the output folder."""
    out = staging.target_dir
    written, names = [], []
    for location, source in data_files.items():
        target = out / location
        written.append(target)
        if not (target.exists() and os.path.samefile(source, target)):
            staging.copy(source, location, progress)
            names.append(location)
    for model, name in ((chunk, CHUNK_MODEL), (decode, DECODE_MODEL)):
        (staging.path / name).write_bytes(model.SerializeToString())
        names.append(name)
    staging.publish(names)
    return written


def fix_shapes(
    model_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    rows: int,
    capacity: int | None = None,
    dims: Mapping[str, int] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> FixedShapes:
    """Write `out_dir/chunk.onnx` (rows = `rows`) and `out_dir/decode.onnx` (rows = 1).

    Rules:
    1. The batch dim_param becomes 1, the rows dim_param `rows` (1 in the decode graph), the
       capacity dim_params `capacity`; `dims` sets any other free dim_param by name.
    2. ConfigError, before anything is written: a `dims` name that is no free dimension of the
       model (the message lists them); `dims` on the rows (set by `rows`) or on the batch with
       a value other than 1; capacity dims given different values (by `dims` or `capacity`);
       a free capacity and no value for it; a capacity below `rows` or above the model's
       maximum sequence length (the rows of its rotary cos cache); rows < 2 (rows 1 is the
       decode graph) and non-positive values.
    3. A model whose rows are already fixed (a fixed graph, such as this function's own
       output) is a ModelStructureError: no decode graph can be made from it.
    4. Any graph input left with a free dimension is a ModelStructureError naming it, to be
       fixed with `dims`; outputs nothing can infer stay free and are reported.
    5. External data must sit inside the model's folder, present and long enough
       (ModelLoadError otherwise); it is copied once into `out_dir` under its relative names
       and shared by both graphs; the source model is never modified.
    6. Existing outputs are replaced only when they are this model's earlier output (the
       graphs record `source_digest`), never the input itself nor another model's files
       (`_check_targets`, OutputError).
    7. Nothing appears in `out_dir` unless everything was written (OutputError otherwise); a
       folder this call created is removed again (`staged_output.staged_write`).
    8. The rows and capacity reported are read back from the written graphs.
    9. Recurrent or conv state is a ModelStructureError, before anything is written
       (`_refuse_state`).
    10. The capacity axis of each GQA present output (the past's buffer, written in place)
       is a capacity dimension too: a window-sized cache's `total_sliding_length` becomes C.
    11. `progress(done, total)` follows the bytes of external data read: hashed once, then
       copied (total counts both passes; a file already in place is not copied).
    """
    source = Path(model_path)
    if rows < 2:
        raise ConfigError(f"--rows must be at least 2 (rows 1 is the decode graph), got {rows}")
    extra = dict(dims or {})
    bad = {name: value for name, value in extra.items() if value < 1}
    if bad:
        raise ConfigError(f"dimension values must be at least 1, got {bad}")
    # load_model checks the external data (inside the model's folder, present, long enough).
    loaded = load_model(source)
    data_files = external_data_files(loaded)
    kv = find_kv_capacity(loaded)
    _refuse_state(source, loaded)
    max_length = kv.max_sequence_length
    model = onnx.load(source, load_external_data=False)
    extra = {**_head_dims(loaded, kv), **extra}

    free = {param for params in _free_dims(list(model.graph.input) + list(model.graph.output))
            .values() for param in params if param != "?"}
    unknown = sorted(set(extra) - free)
    if unknown:
        raise ConfigError(
            f"--dim {', '.join(unknown)}: {source} has no free dimension of that name; its free "
            f"dimensions are {', '.join(sorted(free)) or 'none'}")
    batch, rows_param, capacity_params = _role_dims(model.graph)
    capacity_params |= _present_capacity_dims(model.graph, kv)
    if rows_param is None:
        fixed_rows = _dims(_token_input(model.graph))[1]
        raise ModelStructureError(
            f"the query rows of {source} are already fixed"
            + (f" at {fixed_rows.dim_value}" if fixed_rows.HasField("dim_value") else "")
            + "; fix-shapes takes the dynamic export (rows a free dimension), not a fixed graph")
    if rows_param in extra:
        raise ConfigError(
            f"--dim {rows_param}={extra[rows_param]} names the query rows, which --rows sets "
            f"(--rows {rows}); drop the --dim and give the rows with --rows")
    if batch in extra and extra[batch] != 1:
        raise ConfigError(f"--dim {batch}={extra[batch]} names the batch, which the fixed "
                          f"graphs take as 1; drop the --dim")
    capacity = _resolve_capacity(capacity, {param: extra.pop(param) for param in
                                            capacity_params if param in extra},
                                 capacity_params, rows, max_length)
    if capacity is not None:
        check_window_capacity(kv.bindings, capacity)
    values: dict[str, int] = {}
    if batch:
        values[batch] = 1
    values.update({param: capacity for param in capacity_params})
    if rows_param in values:
        raise ModelStructureError(
            f"the rows dimension {rows_param!r} is also used as a batch or capacity dimension; "
            f"fix them by hand with --dim NAME=VALUE"
        )
    chunk_values = {**values, rows_param: rows, **extra}
    decode_values = {**values, rows_param: 1, **extra}
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
    advance = _progress_counter(progress, data_files, out_dir)
    try:
        digest = source_digest(model, data_files, advance)
    except OSError as error:
        raise ModelLoadError(f"cannot read {source}'s weights: {error}; check its external "
                             f"data files") from error
    for fixed in (chunk, decode):
        onnx.helper.set_model_props(fixed, {
            **{prop.key: prop.value for prop in fixed.metadata_props}, SOURCE_KEY: digest})

    out = Path(out_dir)
    chunk_path, decode_path = out / CHUNK_MODEL, out / DECODE_MODEL
    _check_targets(source, digest, out, data_files)
    try:
        with staged_write(out, CHUNK_MODEL) as staging:
            written = _write_outputs(staging, data_files, chunk, decode, advance)
    except OutputError:  # already says what to do; an OSError too, not to be wrapped
        raise
    except OSError as error:
        raise OutputError(f"cannot write into {out}: {error}; choose a writable folder") \
            from error
    (chunk_rows, capacity_read), (decode_rows, _) = (_written_sizes(chunk_path),
                                                     _written_sizes(decode_path))
    logger.info("fixed %s: %s (rows %d) and %s (rows %d), capacity %s, dims %s", source,
                chunk_path, chunk_rows, decode_path, decode_rows, capacity_read, chunk_values)
    return FixedShapes(chunk_path, decode_path, chunk_rows, decode_rows, capacity_read,
                       chunk_values, written, free_outputs)


def _refuse_state(source: Path, model: ir.Model) -> None:
    """ModelStructureError for recurrent or conv state (`find_recurrent_state`): the right
    padding of the last fixed-row chunk would be folded into the state, which the next forward
    cannot undo."""
    state = [binding.input for binding in find_recurrent_state(model).bindings]
    if state:
        raise ModelStructureError(
            f"{source} carries recurrent or conv state ({', '.join(state[:3])}"
            f"{', ...' if len(state) > 3 else ''}), into which fixed-row chunks padded on the "
            f"right would fold their padding; run the dynamic model instead (onnx-chunk "
            f"generate {source.parent})")


def _resolve_capacity(capacity: int | None, from_dims: Mapping[str, int],
                      capacity_params: set[str], rows: int, max_length: int | None) -> int | None:
    """The one KV capacity of `capacity` and the capacity dims named with --dim; None when the
    model has no capacity dimension and none was given."""
    given = {**from_dims, **({"--capacity": capacity} if capacity is not None else {})}
    if len(set(given.values())) > 1:
        listed = ", ".join(f"{name}={value}" for name, value in sorted(given.items()))
        raise ConfigError(
            f"the KV capacity is given different values ({listed}); the past length and the "
            f"mask width are one capacity C: give it once with --capacity")
    value = next(iter(given.values()), None)
    if value is None:
        if capacity_params:
            raise ConfigError(
                f"the KV capacity dimension(s) {', '.join(sorted(capacity_params))} are free; "
                f"pass --capacity C (C = max prompt length + max new tokens)")
        return None
    if value < rows:
        raise ConfigError(f"capacity {value} is smaller than rows {rows}; use C >= rows")
    if max_length is not None and value > max_length:
        raise ConfigError(
            f"capacity {value} exceeds the model's maximum sequence length {max_length} (its "
            f"rotary tables end there); use --capacity {max_length} or less")
    return value


def _progress_counter(progress: Callable[[int, int], None] | None,
                      data_files: Mapping[str, Path], out_dir: str | os.PathLike
                      ) -> Callable[[int], None] | None:
    """`progress(done, total)` fed from byte counts: every data file hashed, and copied unless
    it already is the file in `out_dir`."""
    if progress is None:
        return None
    out = Path(out_dir)
    total = 0
    for location, source in data_files.items():
        size = source.stat().st_size
        target = out / location
        total += size if target.exists() and os.path.samefile(source, target) else 2 * size
    done = 0

    def advance(count: int) -> None:
        nonlocal done
        done += count
        progress(done, total)

    return advance
