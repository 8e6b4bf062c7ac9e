"""Loading and saving decoders without ever reading their weights into memory.

`load_model` parses only the protobuf; external tensors stay lazy (onnx_ir maps them on first
use, and the passes never use them). Their locations are checked against the file system
without being read. `save_model` writes the protobuf with the external references unchanged and
copies the external data files in fixed-size blocks, so peak memory does not grow with the
model.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError
from onnx.external_data_helper import ExternalDataInfo

from onnx_chunk.errors import ModelLoadError, OutputError

logger = logging.getLogger(__name__)

_COPY_BLOCK_BYTES = 16 << 20


def load_model(path: str | os.PathLike) -> ir.Model:
    """Load a model's graph, leaving external weights on disk.

    Raises ModelLoadError when the file is missing, not an ONNX protobuf, truncated, or when
    its external data is missing, too short, or lies outside the model's folder.
    """
    model_path = Path(path)
    if not model_path.exists():
        raise ModelLoadError(f"model file {str(model_path)!r} does not exist; expected the path "
                             "of an exported decoder's .onnx file")
    if model_path.is_dir():
        raise ModelLoadError(f"{str(model_path)!r} is a folder; pass the .onnx file inside it")
    try:
        proto = onnx.load(str(model_path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as error:
        raise ModelLoadError(
            f"{str(model_path)!r} is not a readable ONNX protobuf ({error}); the file may be "
            "truncated or not a model at all: export or copy it again"
        ) from error
    except OSError as error:
        raise ModelLoadError(f"cannot read {str(model_path)!r}: {error.strerror}") from error
    if proto.ir_version == 0 or not proto.HasField("graph"):
        raise ModelLoadError(
            f"{str(model_path)!r} parsed as a protobuf but holds no ONNX model (no IR version "
            "or no graph); the file may be truncated or of another format"
        )
    _check_external_data(proto, model_path.parent)
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as error:  # onnx_ir wraps every deserialisation failure differently
        raise ModelLoadError(
            f"{str(model_path)!r} is not a well-formed ONNX model ({error}); export it again"
        ) from error
    ir.external_data.set_base_dir(model.graph, str(model_path.parent))
    return model


def _all_tensor_protos(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _all_tensor_protos(attribute.g)
            for subgraph in attribute.graphs:
                yield from _all_tensor_protos(subgraph)


def _check_external_data(proto: onnx.ModelProto, base_dir: Path) -> None:
    root = base_dir.resolve()
    sizes: dict[Path, int] = {}
    for tensor in _all_tensor_protos(proto.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = ExternalDataInfo(tensor)
        location = (root / info.location).resolve()
        if Path(info.location).is_absolute() or not location.is_relative_to(root):
            raise ModelLoadError(
                f"tensor {tensor.name!r} points to external data {info.location!r}, outside the "
                f"model's folder {str(root)!r}; external data must sit beside the model"
            )
        if location not in sizes:
            if not location.is_file():
                raise ModelLoadError(
                    f"tensor {tensor.name!r} needs external data file {info.location!r}, which "
                    f"is missing from {str(root)!r}; copy it next to the model"
                )
            sizes[location] = location.stat().st_size
        end = (info.offset or 0) + (info.length or 0)
        if end > sizes[location]:
            raise ModelLoadError(
                f"tensor {tensor.name!r} needs bytes up to {end} of {info.location!r}, but the "
                f"file has {sizes[location]}; the external data is truncated: copy it again"
            )


def external_data_files(model: ir.Model) -> dict[str, Path]:
    """The external data files a model references: relative location -> absolute source path."""
    files: dict[str, Path] = {}
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor):
                files[os.fspath(tensor.location)] = Path(tensor.path).resolve()
    return files


@contextmanager
def _replacing(target: Path) -> Iterator[Path]:
    """A temporary file beside `target` that replaces it only when the block succeeds."""
    handle, temp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                                         dir=target.parent)
    os.close(handle)
    temp = Path(temp_name)
    # mkstemp creates the file owner-only; give it the mode a plain open() would.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temp, 0o666 & ~umask)
    try:
        yield temp
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)


def _copy_file(source: Path, target: Path, progress: Callable[[int], None] | None) -> None:
    buffer = bytearray(_COPY_BLOCK_BYTES)
    view = memoryview(buffer)
    with _replacing(target) as temp, source.open("rb") as src, temp.open("wb") as dst:
        while count := src.readinto(buffer):
            dst.write(view[:count])
            if progress is not None:
                progress(count)


def save_model(
    model: ir.Model,
    path: str | os.PathLike,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write `model` to `path`, keeping its external data external.

    External data files are copied block by block into the target folder (under the same
    relative locations) unless they already are the files there. Every file is written to a
    temporary name and renamed into place. `progress` receives the byte count of each block
    copied. Raises OutputError when the target cannot be written.
    """
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target_dir = target.parent.resolve()
        for location, source in external_data_files(model).items():
            destination = (target_dir / location).resolve()
            if destination.exists() and os.path.samefile(source, destination):
                continue
            logger.info("copying external data %s -> %s", source, destination)
            destination.parent.mkdir(parents=True, exist_ok=True)
            _copy_file(source, destination, progress)
        proto = ir.serde.serialize_model(model)
        with _replacing(target) as temp:
            temp.write_bytes(proto.SerializeToString())
    except OSError as error:
        raise OutputError(
            f"cannot write {str(target)!r}: {error.strerror or error}; choose a writable "
            "output folder with room for the model"
        ) from error


# Files a runtime reads beside the model: onnxruntime-genai's config, tokenizer files and the
# embedding table of inputs_embeds decoders.
COMPANION_FILES = (
    "genai_config.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "embeddings.npy",
)


def copy_companion_files(source_dir: str | os.PathLike,
                         target_dir: str | os.PathLike) -> list[str]:
    """Copy the COMPANION_FILES present in `source_dir` into `target_dir`; return their names.

    Nothing is copied when both are the same folder. Raises OutputError on a write failure.
    """
    source, target = Path(source_dir).resolve(), Path(target_dir).resolve()
    if source == target:
        return []
    copied: list[str] = []
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name in COMPANION_FILES:
            if (source / name).is_file():
                _copy_file(source / name, target / name, None)
                copied.append(name)
    except OSError as error:
        raise OutputError(
            f"cannot copy companion files into {str(target)!r}: {error.strerror or error}"
        ) from error
    return copied
