"""What loading a decoder needs from its .onnx file, read without onnx and checked.

`read_model_file(path)` maps the file and reads, from the protobuf wire format
(`onnx_wire`), the IR version, the metadata (the chunked-prefill plan), the main graph's inputs
and outputs, the operators used, and every tensor stored outside the file, without touching a
weight; then it applies the checks every command applies before any work (`check_tensors`):

1. No sparse tensor anywhere (initializers, attributes, subgraphs, functions): onnx_ir drops
   them when it reads a model and the runtime cannot use them, so they are refused, not lost.
2. Every external tensor names a location inside the model's folder (not absolute, not through
   `..`), of a file that exists.
3. Its offset and length are byte counts; its length matches its dtype and shape (no length:
   the bytes to the end of the file must not be more than it needs); offset plus size lies
   inside the file.
4. External tensors have a fixed-width dtype (ONNX stores strings inline only).

These run before any session, with one message per failure for every command. The field
numbers are onnx.proto's, stable since they were assigned.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from onnx_chunk.errors import ModelLoadError
from onnx_chunk.graph.data_types import data_type_name, tensor_nbytes
from onnx_chunk.graph.onnx_wire import (
    LEN,
    VARINT,
    Span,
    WireError,
    as_int,
    as_span,
    fields,
    packed_varints,
    signed64,
    text,
)

# onnx.proto field numbers of the messages read here.
_MODEL_IR_VERSION, _MODEL_GRAPH, _MODEL_METADATA, _MODEL_FUNCTIONS = 1, 7, 14, 25
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_INPUT, _GRAPH_OUTPUT = 1, 5, 11, 12
_GRAPH_SPARSE_INITIALIZER = 15
_NODE_OP_TYPE, _NODE_NAME, _NODE_ATTRIBUTE, _NODE_DOMAIN = 4, 3, 5, 7
_ATTR_NAME, _ATTR_T, _ATTR_G, _ATTR_TENSORS, _ATTR_GRAPHS = 1, 5, 6, 10, 11
_ATTR_SPARSE_TENSOR, _ATTR_SPARSE_TENSORS = 22, 23
_FUNCTION_NODE = 7
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_NAME = 1, 2, 8
_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 13, 14
_SPARSE_VALUES = 1
_ENTRY_KEY, _ENTRY_VALUE = 1, 2
_VALUE_NAME, _VALUE_TYPE = 1, 2
_TYPE_TENSOR = 1
_TENSOR_TYPE_ELEM, _TENSOR_TYPE_SHAPE = 1, 2
_SHAPE_DIM = 1
_DIM_VALUE, _DIM_PARAM = 1, 2
_EXTERNAL = 1

Dim = int | str | None


@dataclass(frozen=True)
class ValueInfo:
    """A graph input or output: its name, element type (None: not a tensor, or undeclared)
    and shape (None: undeclared; a dim is its size, its symbolic name, or None: unknown)."""

    name: str
    elem_type: int | None
    shape: tuple[Dim, ...] | None


@dataclass(frozen=True)
class TensorRef:
    """A tensor as the file stores it, without its data: `external` holds its external-data
    entries (location, offset, length...) when its bytes lie in another file, else None.
    `initializer`: an initializer of the main graph or a subgraph (not a function's)."""

    name: str
    data_type: int
    dims: tuple[int, ...]
    external: dict[str, str] | None
    initializer: bool


@dataclass(frozen=True)
class ModelFile:
    """The parts of an .onnx file that loading reads (see the module docstring)."""

    path: Path
    ir_version: int
    metadata: dict[str, str]
    inputs: tuple[ValueInfo, ...]
    outputs: tuple[ValueInfo, ...]
    operators: frozenset[tuple[str, str]]
    tensors: tuple[TensorRef, ...]
    sparse: tuple[str, ...]

    def uses(self, op_type: str, domain: str = "") -> bool:
        """Whether a node of the main graph or a subgraph runs (domain, op_type)."""
        return (domain, op_type) in self.operators

    def data_files(self) -> set[Path]:
        """The files the external tensors name, beside the model (checked by `check_tensors`)."""
        return {self.path.parent / tensor.external["location"] for tensor in self.tensors
                if tensor.external is not None and tensor.external.get("location")}

    def external_initializers(self) -> Iterator[tuple[TensorRef, ExternalData]]:
        """Every initializer stored outside the file, with where its bytes are."""
        resolved: dict[str, Path] = {}
        for tensor in self.tensors:
            if tensor.initializer and tensor.external is not None:
                yield tensor, external_data(tensor, self.path.parent, resolved)


@dataclass(frozen=True)
class ExternalData:
    """Where an external tensor's bytes are: a file inside the model's folder."""

    location: str
    path: Path
    offset: int
    length: int | None


# The most dimensions a stored tensor may have (onnx's checker allows any; real weights have
# at most a handful).
_MAX_RANK = 64


def read_model_file(path: str | os.PathLike, data: bytes | None = None) -> ModelFile:
    """The file's metadata, I/O, operators and external tensor index, checked.

    `data`: the model's serialized bytes, read in place of the file's (an edited graph whose
    external data lies beside `path`).

    ModelLoadError when the file is missing, a folder, not an ONNX protobuf (or truncated), or
    when a check of `check_tensors` fails.
    """
    model_path = Path(path)
    if data is not None:
        try:
            model = _Reader(data).model(model_path)
        except WireError as error:
            raise unreadable(model_path, error) from error
        check_tensors(model)
        return model
    if not model_path.exists():
        raise ModelLoadError(f"model file {str(model_path)!r} does not exist; expected the path "
                             "of an exported decoder's .onnx file")
    if model_path.is_dir():
        raise ModelLoadError(f"{str(model_path)!r} is a folder; pass the .onnx file inside it")
    try:
        with model_path.open("rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size == 0:
                model = _Reader(b"").model(model_path)
            else:
                with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    model = _Reader(mapped).model(model_path)
    except (WireError, OSError) as error:
        raise unreadable(model_path, error) from error
    check_tensors(model)
    return model


def unreadable(path: Path, error: Exception) -> ModelLoadError:
    """The error for a model file that cannot be read (OSError) or parsed (any other)."""
    if isinstance(error, OSError):
        return ModelLoadError(f"cannot read {str(path)!r}: {error.strerror}")
    return ModelLoadError(
        f"{str(path)!r} is not a readable ONNX protobuf ({error}); the file may be "
        "truncated or not a model at all: export or copy it again")


# How deep graphs may nest in one another (a node's graph attribute): protobuf's own parser
# stops at 100 nested messages, which a graph nesting this deep (3 messages a level) reaches.
MAX_GRAPH_DEPTH = 32


class _Reader:
    """Reads the messages of one file's bytes; collects tensors and operators as it goes."""

    def __init__(self, data) -> None:
        self.data = data
        self.depth = 0
        self.tensors: list[TensorRef] = []
        self.sparse: list[str] = []
        self.operators: set[tuple[str, str]] = set()

    def model(self, path: Path) -> ModelFile:
        data = self.data
        ir_version = 0
        graph: Span | None = None
        metadata: dict[str, str] = {}
        functions: list[Span] = []
        for number, wire, value in fields(data, 0, len(data)):
            if number == _MODEL_IR_VERSION and wire == VARINT:
                ir_version = as_int(value)
            elif number == _MODEL_GRAPH and wire == LEN:
                graph = as_span(value)
            elif number == _MODEL_METADATA and wire == LEN:
                key, entry = self._entry(as_span(value))
                metadata[key] = entry
            elif number == _MODEL_FUNCTIONS and wire == LEN:
                functions.append(as_span(value))
        if ir_version == 0 or graph is None:
            raise ModelLoadError(
                f"{str(path)!r} parsed as a protobuf but holds no ONNX model (no IR version "
                "or no graph); the file may be truncated or of another format")
        inputs, outputs = self._graph(graph, top=True)
        for function in functions:
            for number, wire, value in fields(data, *function):
                if number == _FUNCTION_NODE and wire == LEN:
                    self._node(as_span(value), in_function=True)
        return ModelFile(path=path, ir_version=ir_version, metadata=metadata,
                         inputs=tuple(inputs), outputs=tuple(outputs),
                         operators=frozenset(self.operators), tensors=tuple(self.tensors),
                         sparse=tuple(self.sparse))

    def _entry(self, span: Span) -> tuple[str, str]:
        key = value = ""
        for number, wire, field in fields(self.data, *span):
            if wire == LEN and number == _ENTRY_KEY:
                key = text(self.data, as_span(field))
            elif wire == LEN and number == _ENTRY_VALUE:
                value = text(self.data, as_span(field))
        return key, value

    def _graph(self, span: Span, *, top: bool = False,
               in_function: bool = False) -> tuple[list[ValueInfo], list[ValueInfo]]:
        inputs: list[ValueInfo] = []
        outputs: list[ValueInfo] = []
        self.depth += 1
        if self.depth > MAX_GRAPH_DEPTH:
            raise WireError(f"graphs nest more than {MAX_GRAPH_DEPTH} levels deep")
        for number, wire, field in fields(self.data, *span):
            if wire != LEN:
                continue
            value = as_span(field)
            if number == _GRAPH_NODE:
                self._node(value, in_function)
            elif number == _GRAPH_INITIALIZER:
                self.tensors.append(self._tensor(value, initializer=not in_function))
            elif number == _GRAPH_SPARSE_INITIALIZER:
                self.sparse.append(self._sparse_name(value))
            elif top and number == _GRAPH_INPUT:
                inputs.append(self._value_info(value))
            elif top and number == _GRAPH_OUTPUT:
                outputs.append(self._value_info(value))
        self.depth -= 1
        return inputs, outputs

    def _node(self, span: Span, in_function: bool) -> None:
        op_type = name = domain = ""
        attributes: list[Span] = []
        for number, wire, field in fields(self.data, *span):
            if wire != LEN:
                continue
            value = as_span(field)
            if number == _NODE_OP_TYPE:
                op_type = text(self.data, value)
            elif number == _NODE_NAME:
                name = text(self.data, value)
            elif number == _NODE_DOMAIN:
                domain = text(self.data, value)
            elif number == _NODE_ATTRIBUTE:
                attributes.append(value)
        if not in_function:
            self.operators.add(("" if domain == "ai.onnx" else domain, op_type))
        for attribute in attributes:
            self._attribute(attribute, op_type, name, in_function)

    def _attribute(self, span: Span, op_type: str, node: str, in_function: bool) -> None:
        name = ""
        sparse = False
        for number, wire, field in fields(self.data, *span):
            if wire != LEN:
                continue
            value = as_span(field)
            if number == _ATTR_NAME:
                name = text(self.data, value)
            elif number in (_ATTR_T, _ATTR_TENSORS):
                self.tensors.append(self._tensor(value, initializer=False))
            elif number in (_ATTR_G, _ATTR_GRAPHS):
                self._graph(value, in_function=in_function)
            elif number in (_ATTR_SPARSE_TENSOR, _ATTR_SPARSE_TENSORS):
                sparse = True
        if sparse:
            self.sparse.append(f"{op_type} node {node!r} attribute {name!r}")

    def _tensor(self, span: Span, *, initializer: bool) -> TensorRef:
        name = ""
        data_type = 0
        dims: list[int] = []
        entries: dict[str, str] = {}
        location = 0
        for number, wire, value in fields(self.data, *span):
            if number == _TENSOR_DIMS:
                dims.extend(signed64(dim) for dim in packed_varints(self.data, wire, value))
            elif number == _TENSOR_DATA_TYPE and wire == VARINT:
                data_type = as_int(value)
            elif number == _TENSOR_NAME and wire == LEN:
                name = text(self.data, as_span(value))
            elif number == _TENSOR_EXTERNAL_DATA and wire == LEN:
                key, entry = self._entry(as_span(value))
                entries[key] = entry
            elif number == _TENSOR_DATA_LOCATION and wire == VARINT:
                location = as_int(value)
        return TensorRef(name, data_type, tuple(dims),
                         entries if location == _EXTERNAL else None, initializer)

    def _sparse_name(self, span: Span) -> str:
        for number, wire, value in fields(self.data, *span):
            if number == _SPARSE_VALUES and wire == LEN:
                return self._tensor(as_span(value), initializer=False).name
        return ""

    def _value_info(self, span: Span) -> ValueInfo:
        name = ""
        elem_type: int | None = None
        shape: tuple[Dim, ...] | None = None
        for number, wire, value in fields(self.data, *span):
            if number == _VALUE_NAME and wire == LEN:
                name = text(self.data, as_span(value))
            elif number == _VALUE_TYPE and wire == LEN:
                for kind, kind_wire, tensor_type in fields(self.data, *as_span(value)):
                    if kind == _TYPE_TENSOR and kind_wire == LEN:
                        elem_type, shape = self._tensor_type(as_span(tensor_type))
        return ValueInfo(name, elem_type, shape)

    def _tensor_type(self, span: Span) -> tuple[int | None, tuple[Dim, ...] | None]:
        elem_type: int | None = None
        shape: tuple[Dim, ...] | None = None
        for number, wire, value in fields(self.data, *span):
            if number == _TENSOR_TYPE_ELEM and wire == VARINT:
                elem_type = as_int(value) or None
            elif number == _TENSOR_TYPE_SHAPE and wire == LEN:
                shape = tuple(self._dim(as_span(dim)) for dim_number, dim_wire, dim
                              in fields(self.data, *as_span(value))
                              if dim_number == _SHAPE_DIM and dim_wire == LEN)
        return elem_type, shape

    def _dim(self, span: Span) -> Dim:
        dim: Dim = None
        for number, wire, value in fields(self.data, *span):
            if number == _DIM_VALUE and wire == VARINT:
                dim = signed64(as_int(value))
            elif number == _DIM_PARAM and wire == LEN:
                dim = text(self.data, as_span(value)) or None
        return dim


def read_value_info(data, span: Span) -> ValueInfo:
    """The ValueInfoProto at `span` of `data` (a graph input or output)."""
    return _Reader(data)._value_info(span)


def external_data(tensor: TensorRef, base_dir: Path,
                  resolved: dict[str, Path] | None = None) -> ExternalData:
    """Where `tensor`'s external bytes are; ModelLoadError when a field is malformed or the
    location leaves `base_dir`. `resolved` keeps each location's resolved path across the
    tensors of one model (a builder export names one file for hundreds of tensors, and each
    resolve is a system call per path component)."""
    assert tensor.external is not None
    fields_ = tensor.external
    location = fields_.get("location", "")
    if not location:
        raise ModelLoadError(f"tensor {tensor.name!r} is stored externally but names no "
                             "location; export the model again")
    numbers: dict[str, int | None] = {}
    for key in ("offset", "length"):
        value = fields_.get(key)
        if value is None or value == "":
            numbers[key] = None
            continue
        if not (value.isascii() and value.isdigit()):
            raise ModelLoadError(
                f"tensor {tensor.name!r}: external data {key} {value!r} is not a non-negative "
                "integer (a byte count); the model file is corrupt: export it again")
        numbers[key] = int(value)
    if "\x00" in location:
        raise ModelLoadError(f"tensor {tensor.name!r} names external data {location!r}, with a "
                             "NUL character no file name can hold; the model file is corrupt")
    memo = {} if resolved is None else resolved
    if "" not in memo:
        memo[""] = base_dir.resolve()
    root = memo[""]
    path = memo.get(location)
    if path is None:
        path = memo[location] = (root / location).resolve()
    if Path(location).is_absolute() or not path.is_relative_to(root):
        raise ModelLoadError(
            f"tensor {tensor.name!r} points to external data {location!r}, outside the "
            f"model's folder {str(root)!r}; external data must sit beside the model")
    return ExternalData(location, path, numbers["offset"] or 0, numbers["length"])


def check_tensors(model: ModelFile) -> None:
    """Apply the rules of the module docstring to every tensor of `model`, reading none."""
    if model.sparse:
        names = model.sparse
        raise ModelLoadError(
            f"{str(model.path)!r} holds sparse tensors ({', '.join(map(repr, names[:3]))}"
            f"{', ...' if len(names) > 3 else ''}); onnx-chunk keeps dense tensors only: "
            "densify them first (onnx.numpy_helper.to_array of each sparse tensor, saved as a "
            "dense initializer)")
    root = model.path.parent.resolve()
    sizes: dict[Path, int] = {}
    resolved: dict[str, Path] = {}
    for tensor in model.tensors:
        if tensor.external is None:
            continue
        name = tensor.name
        where = external_data(tensor, root, resolved)
        if where.path not in sizes:
            if not where.path.is_file():
                raise ModelLoadError(
                    f"tensor {name!r} needs external data file {where.location!r}, which "
                    f"is missing from {str(root)!r}; copy it next to the model")
            sizes[where.path] = where.path.stat().st_size
        size = sizes[where.path]
        if any(dim < 0 for dim in tensor.dims) or len(tensor.dims) > _MAX_RANK:
            raise ModelLoadError(
                f"tensor {name!r} has the shape {list(tensor.dims)[:_MAX_RANK + 1]}: a stored "
                f"tensor needs at most {_MAX_RANK} dimensions, none negative; the model file "
                "is corrupt: export it again")
        if where.offset > size:
            raise ModelLoadError(
                f"tensor {name!r} starts at byte {where.offset} of {where.location!r}, past "
                f"its end ({size} bytes); the external data is truncated: copy it again")
        expected = tensor_nbytes(tensor.data_type, tensor.dims)
        if expected is None:
            raise ModelLoadError(
                f"tensor {name!r} is a {data_type_name(tensor.data_type)} tensor stored as "
                "external data, which ONNX does not allow (only fixed-width types can be); "
                "export the model again with it inline")
        stored = where.length if where.length is not None else size - where.offset
        if stored != expected and (where.length is not None or stored > expected):
            raise ModelLoadError(
                f"tensor {name!r} ({data_type_name(tensor.data_type)} {list(tensor.dims)}) "
                f"needs {expected} bytes, but its external data "
                + (f"length is {where.length}" if where.length is not None
                   else f"runs {stored} bytes from offset {where.offset} to the end of "
                        f"{where.location!r} (no length given)")
                + "; the model and its data do not match: export or copy them again")
        end = where.offset + expected
        if end > size:
            raise ModelLoadError(
                f"tensor {name!r} needs bytes up to {end} of {where.location!r}, but the "
                f"file has {size}; the external data is truncated: copy it again")
