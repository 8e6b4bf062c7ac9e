"""A model's external data: the files and byte ranges its tensors reference, where they go
when the model is saved, and copying just the referenced bytes of a file a pass left partly
dead (`save_model` in model_io uses all of it)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import onnx
import onnx_ir as ir

from onnx_chunk.staged_output import copy_ranges

# A compacted file keeps each tensor's offset modulo a page (modulo 64 bytes for one smaller
# than a page).
_PAGE_BYTES = 4096
_SMALL_ALIGN_BYTES = 64
# A copied data file is compacted (only the bytes the model's tensors still reference) when at
# least this much of it is referenced by none: the 4-bit weights `--int8-matmul` or
# `--int4-block-size` replaced, which a whole-file copy would carry along (on llama1b-int4,
# 0.6 GB of the int8 folder's 1.8 GB).
COMPACT_UNREFERENCED_BYTES = 1 << 20


def _graph_tensor_protos(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    yield from _node_tensor_protos(graph.node)


def _node_tensor_protos(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.TensorProto]:
    for node in nodes:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("sparse_tensor"):
                yield attribute.sparse_tensor.values
                yield attribute.sparse_tensor.indices
            for sparse in attribute.sparse_tensors:
                yield sparse.values
                yield sparse.indices
            if attribute.HasField("g"):
                yield from _graph_tensor_protos(attribute.g)
            for subgraph in attribute.graphs:
                yield from _graph_tensor_protos(subgraph)


def all_tensor_protos(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of a model: initializers (sparse too), attributes, subgraphs, functions."""
    yield from _graph_tensor_protos(proto.graph)
    for function in proto.functions:
        yield from _node_tensor_protos(function.node)


def _attribute_tensors(graph: ir.Graph | ir.Function) -> Iterator[ir.TensorProtocol]:
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for attribute in node.attributes.values():
            if attribute.type == ir.AttributeType.TENSOR:
                yield attribute.value
            elif attribute.type == ir.AttributeType.TENSORS:
                yield from attribute.value


def model_tensors(model: ir.Model) -> Iterator[ir.TensorProtocol]:
    for graph in model.graphs():
        for value in graph.initializers.values():
            if value.const_value is not None:
                yield value.const_value
    yield from _attribute_tensors(model.graph)
    for function in model.functions.values():
        yield from _attribute_tensors(function)


def external_data_files(model: ir.Model) -> dict[str, Path]:
    """The external data files a model references: relative location -> absolute source path.

    Initializers, attribute tensors, subgraphs and model-local functions all count.
    """
    files: dict[str, Path] = {}
    for tensor in model_tensors(model):
        if isinstance(tensor, ir.ExternalTensor):
            files[os.fspath(tensor.location)] = Path(tensor.path).resolve()
    return files


Entry = tuple[str, int, int | None]  # (location, offset, length) of one external tensor
Layout = dict[tuple[int, int], int]  # (old offset, length) -> new offset


def external_entries(model: ir.Model | onnx.ModelProto) -> Iterator[Entry]:
    """(location, offset, length or None) of every external tensor of `model`: an onnx_ir model
    (what a save will write) or its serialized proto (what it writes)."""
    if isinstance(model, onnx.ModelProto):
        for proto in all_tensor_protos(model):
            if proto.data_location == onnx.TensorProto.EXTERNAL:
                info = {entry.key: entry.value for entry in proto.external_data}
                yield (info.get("location", ""), int(info.get("offset", 0)),
                       int(info["length"]) if "length" in info else None)
        return
    for tensor in model_tensors(model):
        if isinstance(tensor, ir.ExternalTensor):
            yield os.fspath(tensor.location), tensor.offset or 0, tensor.length


def referenced_ranges(entries: Iterable[Entry], location: str) -> list[tuple[int, int]] | None:
    """The (offset, length) byte ranges of data file `location` that `entries` reference,
    sorted and distinct; None where they cannot be compacted safely (a tensor without a
    length, or two tensors overlapping without being the same range)."""
    ranges = set()
    for where, offset, length in entries:
        if where == location:
            if length is None:
                return None
            ranges.add((offset, length))
    ordered = sorted(ranges)
    if any(later[0] < earlier[0] + earlier[1] for earlier, later in zip(ordered, ordered[1:])):
        return None
    return ordered


def _layout(ranges: list[tuple[int, int]]) -> tuple[Layout, int]:
    """Where each range goes in a compacted file, one after another in their order, and its
    size: a tensor of at least a page at an offset congruent to its old one modulo a page (any
    alignment the exporter gave it for mapping holds), a smaller one modulo 64 bytes."""
    moved: Layout = {}
    position = 0
    for offset, length in ranges:
        modulus = _PAGE_BYTES if length >= _PAGE_BYTES else _SMALL_ALIGN_BYTES
        moved[(offset, length)] = position = position + (offset - position) % modulus
        position += length
    return moved, position


def compacted_layout(entries: Iterable[Entry], location: str, source: Path) -> Layout | None:
    """The layout of data file `location` (at `source`) compacted to what `entries` reference,
    when that saves COMPACT_UNREFERENCED_BYTES or more; else None: the file is copied whole."""
    ranges = referenced_ranges(entries, location)
    if ranges is None:
        return None
    moved, size = _layout(ranges)
    return moved if source.stat().st_size - size >= COMPACT_UNREFERENCED_BYTES else None


def bytes_to_copy(model: ir.Model, target: Path) -> int:
    """How many bytes of external data `save_model(model, target)` copies: whole files, or the
    referenced bytes of a file it compacts; none of a file already in place."""
    files = external_data_files(model)
    entries = list(external_entries(model))
    total = 0
    for location, written in output_locations(files, target).items():
        source, destination = files[location], target.parent / written
        if destination.exists() and os.path.samefile(source, destination):
            continue
        layout = compacted_layout(entries, location, source)
        total += (source.stat().st_size if layout is None
                  else sum(length for _, length in layout))
    return total


def copy_layout(source: Path, staged: Path, layout: Layout,
                progress: Callable[[int], None] | None) -> None:
    """Copy each range of `source` to its place in `layout` in `staged` (zeros between them),
    with `source`'s permission bits; `progress` gets the byte count of each block."""
    placed = sorted(((offset, length, start) for (offset, length), start in layout.items()),
                    key=lambda each: each[2])
    copy_ranges(source, staged, placed, progress)


def move_offsets(proto: onnx.ModelProto, location: str, layout: Layout) -> None:
    """Point `proto`'s tensors in data file `location` at their offsets in its compacted copy
    (`layout`, made from this proto's own entries)."""
    for tensor in all_tensor_protos(proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entries = {entry.key: entry for entry in tensor.external_data}
        if "location" not in entries or entries["location"].value != location:
            continue
        offset = int(entries["offset"].value) if "offset" in entries else 0
        new = layout[(offset, int(entries["length"].value))]
        if "offset" in entries:
            entries["offset"].value = str(new)
        else:
            tensor.external_data.add(key="offset", value=str(new))


def output_locations(files: dict[str, Path], target: Path) -> dict[str, str]:
    """Where each external data file of a model goes when it is written to `target`.

    Rules:
    1. A file that already is the one at its location beside `target` keeps its name (an
       in-place rewrite copies no weights).
    2. Otherwise a model's single data file is named after the output: `<target name>.data`,
       so two models written into one folder never share (and overwrite) a data file.
    3. Several data files keep their names (their owners are checked before anything is
       written).
    """
    target_dir = target.parent
    locations: dict[str, str] = {}
    for location, source in files.items():
        destination = target_dir / location
        in_place = destination.exists() and os.path.samefile(source, destination)
        locations[location] = (location if in_place or len(files) > 1
                               else f"{target.name}.data")
    return locations


def relocate(proto: onnx.ModelProto, locations: dict[str, str]) -> None:
    """Rewrite the external locations of `proto`'s tensors (offsets and lengths kept)."""
    for tensor in all_tensor_protos(proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value in locations:
                entry.value = locations[entry.value]
