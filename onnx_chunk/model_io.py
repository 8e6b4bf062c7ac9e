"""Loading and saving decoders without ever reading their weights into memory.

`load_model` parses only the protobuf; external tensors stay lazy (onnx_ir maps them on first
use, and the passes never use them). Their locations are checked against the file system
without being read. `save_model` writes the protobuf with the external references unchanged and
copies the external data files in fixed-size blocks, so peak memory does not grow with the
model; it stages every file and renames them into place only once all are written.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
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
    check_external_data(proto, model_path.parent)
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


def check_external_data(proto: onnx.ModelProto, base_dir: str | os.PathLike) -> None:
    """Check every external tensor of `proto` against the files in `base_dir`, reading none.

    Raises ModelLoadError when a location is absolute or leaves `base_dir`, when a file is
    missing, or when a file is shorter than a tensor's offset plus length.
    """
    root = Path(base_dir).resolve()
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


# The earlier private name, kept for callers written against it.
_check_external_data = check_external_data


def external_data_files(model: ir.Model) -> dict[str, Path]:
    """The external data files a model references: relative location -> absolute source path."""
    files: dict[str, Path] = {}
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor):
                files[os.fspath(tensor.location)] = Path(tensor.path).resolve()
    return files


def _copy_file(source: Path, target: Path, progress: Callable[[int], None] | None) -> None:
    buffer = bytearray(_COPY_BLOCK_BYTES)
    view = memoryview(buffer)
    with source.open("rb") as src, target.open("wb") as dst:
        while count := src.readinto(buffer):
            dst.write(view[:count])
            if progress is not None:
                progress(count)


def _write_proto(model: ir.Model, target: Path) -> None:
    target.write_bytes(ir.serde.serialize_model(model).SerializeToString())


def _make_folder(folder: Path) -> Path | None:
    """Create `folder` and its missing parents; return the topmost one created, if any."""
    missing = [parent for parent in (folder, *folder.parents) if not parent.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return missing[-1] if missing else None


def save_model(
    model: ir.Model,
    path: str | os.PathLike,
    progress: Callable[[int], None] | None = None,
    *,
    companions_from: str | os.PathLike | None = None,
) -> list[str]:
    """Write `model` to `path`, keeping its external data external; return the companions copied.

    External data files are copied block by block into the target folder (under the same
    relative locations) unless they already are the files there, so an in-place rewrite copies
    no weights. With `companions_from`, the COMPANION_FILES found in that folder are copied too
    (none when it is the target folder). Everything is staged in a temporary folder beside
    `path` and renamed into place at the end, the .onnx file last; on failure the staging
    folder and any folder this call created are removed, so no partial output is left.
    `progress` receives the byte count of each block copied. Raises OutputError when the
    target cannot be written.
    """
    target = Path(path)
    created: Path | None = None
    staging: Path | None = None
    try:
        created = _make_folder(target.parent)
        target_dir = target.parent.resolve()
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".staging",
                                        dir=target_dir))
        staged: list[str] = []
        for location, source in external_data_files(model).items():
            destination = (target_dir / location).resolve()
            if destination.exists() and os.path.samefile(source, destination):
                continue
            logger.info("copying external data %s -> %s", source, destination)
            (staging / location).parent.mkdir(parents=True, exist_ok=True)
            _copy_file(source, staging / location, progress)
            staged.append(location)
        companions = _stage_companions(companions_from, target_dir, staging)
        _write_proto(model, staging / target.name)
        for name in (*staged, *companions, target.name):
            (target_dir / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / name, target_dir / name)
    except OSError as error:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise OutputError(
            f"cannot write {str(target)!r}: {error.strerror or error}; choose a writable "
            "output folder with room for the model"
        ) from error
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return companions


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


def _stage_companions(source_dir: str | os.PathLike | None, target_dir: Path,
                      staging: Path) -> list[str]:
    """Copy the COMPANION_FILES present in `source_dir` into `staging`; return their names."""
    if source_dir is None or Path(source_dir).resolve() == target_dir:
        return []
    source = Path(source_dir)
    names = [name for name in COMPANION_FILES if (source / name).is_file()]
    for name in names:
        _copy_file(source / name, staging / name, None)
    return names
