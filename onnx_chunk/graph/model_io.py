"""Loading and saving decoders without ever reading their weights into memory.

`load_model` parses only the protobuf; external tensors stay lazy (onnx_ir maps them on first
use, and the passes never use them). Their locations are checked against the file system
without being read. `save_model` writes the protobuf with the external references unchanged and
copies the external data files in fixed-size blocks, so peak memory does not grow with the
model; it stages every file and renames them into place only once all are written
(onnx_chunk.staged_output, the one way every command writes its output files).

Weights a pass computes anew (`--int4-block-size`, `--int8-matmul`; marked with
`write_to_data_file`) go to a data file of their own beside the model, not inside the .onnx.
ONNX Runtime memory-maps an external initializer on the CPU and unmaps it when a kernel has
pre-packed it and released the original (`SessionState::PrepackConstantInitializedTensors`,
onnxruntime/core/framework/session_state.cc: once every node that reads a constant initializer
has packed it, the initializer's value is erased, and with it the mapping); one inside the
.onnx is copied into malloc'd memory instead, and glibc keeps those freed buffers (each a few
MiB, under its dynamic mmap threshold) in its heap. On qwen05-int4 with `--int8-matmul` (ONNX
Runtime 1.32) that held the 360 MB of int8 weights beside their packed copy: 905 MB resident
after load (peak 970) against 609 MB (peak 683) with the weights in a data file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from onnx_chunk.errors import ModelLoadError, OutputError
from onnx_chunk.graph.external_data import (
    all_tensor_protos,
    compacted_layout,
    copy_layout,
    external_data_files,
    external_entries,
    model_tensors,
    move_offsets,
    output_locations,
    relocate,
)
from onnx_chunk.graph.model_file import read_model_file, unreadable
from onnx_chunk.graph.model_folder import DEFAULT_DECODER, GENAI_CONFIG, read_genai_config
from onnx_chunk.graph.operator_types import type_errors
from onnx_chunk.staged_output import COPY_BLOCK_BYTES, Staging, staged_write

logger = logging.getLogger(__name__)

# `ir.Value.meta` key of an initializer `save_model` writes to the model's new-weights file.
_TO_DATA_FILE = "onnx_chunk.to_data_file"
# Marked tensors smaller than this stay inside the .onnx (ONNX's own default threshold).
_DATA_FILE_THRESHOLD_BYTES = 1024
# Offsets of tensors over 1 MiB in the new-weights file are aligned to whole pages.
_ALIGN_BYTES = 4096


def write_to_data_file(value: ir.Value) -> ir.Value:
    """Mark the initializer `value` (weights a pass computed) for `save_model` to write to the
    model's new-weights data file instead of inside the .onnx; returns `value`."""
    value.meta[_TO_DATA_FILE] = True
    return value


def load_model(path: str | os.PathLike, *, check_graph: bool = True) -> ir.Model:
    """Load a model's graph, leaving external weights on disk.

    Raises ModelLoadError when the file is missing, not an ONNX protobuf, truncated, when a
    check of `model_file.check_tensors` fails (sparse tensors; external data missing, too short,
    or outside the model's folder), or, with `check_graph`, when a node reads a value that
    nothing defines (`undefined_inputs`) or its declared types break ONNX Runtime's type rules
    (`operator_types.type_errors`): graphs ONNX Runtime refuses to load. `validate` reports those
    through its structure.checker check instead.
    """
    model_path = Path(path)
    read_model_file(model_path)
    try:
        proto = onnx.load(str(model_path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as error:
        raise unreadable(model_path, error) from error
    try:
        with _quiet_undefined_inputs():
            model = ir.serde.deserialize_model(proto)
    except Exception as error:  # onnx_ir wraps every deserialisation failure differently
        raise ModelLoadError(
            f"{str(model_path)!r} is not a well-formed ONNX model ({error}); export it again"
        ) from error
    if check_graph and (undefined := undefined_inputs(model.graph)):
        shown = ", ".join(f"node {node.name or node.op_type!r} reads {value.name!r}"
                          for node, value in undefined[:3])
        more = f" (and {len(undefined) - 3} more)" if len(undefined) > 3 else ""
        raise ModelLoadError(
            f"{str(model_path)!r} is not a well-formed ONNX model: {shown}{more}, which no "
            "initializer, graph input or node defines (ONNX Runtime cannot load it); "
            "export it again")
    if check_graph and (errors := type_errors(model)):
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ModelLoadError(
            f"{str(model_path)!r} is not a well-formed ONNX model: {errors[0]}{more}; ONNX "
            "Runtime cannot load it; export it again")
    for tensor in model_tensors(model):
        if isinstance(tensor, ir.ExternalTensor):
            tensor.base_dir = str(model_path.parent)
    return model


def undefined_inputs(graph: ir.Graph) -> list[tuple[ir.Node, ir.Value]]:
    """Each (node, input) of `graph` and its subgraphs whose value no initializer, graph input
    or node defines: onnx_ir's deserializer makes a value of its own for such a name (with a
    warning) where ONNX Runtime refuses the model ("is not a graph input, initializer, or output
    of a previous node"). A subgraph's reference to an outer value is that value, so it counts
    as defined."""
    return [(node, value) for node in ir.traversal.RecursiveGraphIterator(graph)
            for value in node.inputs
            if value is not None and value.producer() is None
            and not value.is_graph_input() and not value.is_initializer()]


class _UndefinedInputWarning(logging.Filter):
    """Drops onnx_ir's warnings for an input defined nowhere (the second one where it is read in
    a subgraph; onnx_ir 1.1.0, serde.py); `load_model` says it in its error."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("cannot be found in any scope" in message
                    or message.startswith("Caveat: The value is created in the subgraph"))


@contextlib.contextmanager
def _quiet_undefined_inputs() -> Iterator[None]:
    serde_logger = logging.getLogger("onnx_ir.serde")
    quiet = _UndefinedInputWarning()
    serde_logger.addFilter(quiet)
    try:
        yield
    finally:
        serde_logger.removeFilter(quiet)


def check_weights_readable(model: ir.Model, option: str) -> None:
    """ModelLoadError, before any work, when `option` must read the weights and an external
    data file has several hard links: onnx_ir refuses to read such a file (its guard against
    hard-link attacks, `ExternalTensor`), which would stop the conversion half way."""
    for path in sorted(set(external_data_files(model).values())):
        try:
            links = path.stat().st_nlink
        except OSError as error:
            raise ModelLoadError(f"cannot read the weights {str(path)!r}: {error}") from error
        if links > 1:
            raise ModelLoadError(
                f"{option} reads the weights, and {str(path)!r} has {links} hard links, which "
                "onnx_ir refuses to read (a guard against hard-link attacks); give the file a "
                "copy of its own (cp FILE FILE.copy && mv FILE.copy FILE) or remove its other "
                "names")


def write_proto(proto: onnx.ModelProto, target: Path) -> None:
    """Write `proto`'s bytes to `target`."""
    target.write_bytes(proto.SerializeToString())


def referenced_data_files(model_path: Path) -> set[Path]:
    """The external data files (resolved) a model file references; none when it is unreadable."""
    try:
        proto = onnx.load(str(model_path), load_external_data=False)
    except Exception as error:  # onnx raises many types for files that are no model
        logger.warning("cannot read %s to see which data files it uses: %s", model_path, error)
        return set()
    files = set()
    for tensor in all_tensor_protos(proto):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = next((entry.value for entry in tensor.external_data
                             if entry.key == "location"), "")
            if location:
                files.add((model_path.parent / location).resolve())
    return files


def _config_decoder(path: Path) -> tuple[dict, str | None]:
    """A genai config's JSON document and the decoder file it names (None: it names none).

    ModelLoadError when the file is no JSON object or its sections are not what genai reads.
    """
    genai = read_genai_config(path)
    if genai is None:
        raise ModelLoadError(f"{str(path)!r} does not exist")
    return genai.document, genai.filename


def _config_is_foreign(path: Path, target: Path) -> bool:
    """Whether the genai config at `path` belongs to a model other than `target`.

    It does when it names another file, or names none while model.onnx (its default) exists
    and is not `target`.
    """
    named = _config_decoder(path)[1]
    if named is not None:
        return named != target.name
    default = path.parent / DEFAULT_DECODER
    return default.exists() and target.name != DEFAULT_DECODER


def _refuse_foreign(target: Path, data_writes: list[str], companion_writes: list[str],
                    companion_sources: Path | None) -> list[str]:
    """Check that nothing written beside `target` belongs to another model there.

    Rules:
    1. A data file that another .onnx file in the folder references is that model's.
    2. A genai_config.json there is another model's when it names another decoder, or names
       none while model.onnx (its default) exists and is not `target`.
    3. Beside another model, any other companion is shared only when its bytes equal the
       source's (then it is left as it is); with other bytes it is that model's.
    Returns the companions left to copy. Raises OutputError naming the first file that
    belongs to another model.
    """
    folder = target.parent
    others = [path for path in sorted(folder.glob("*.onnx"))
              if path.name != target.name and path.is_file()]
    owned = {path: referenced_data_files(path) for path in others}
    for location in data_writes:
        destination = (folder / location).resolve()
        for other, files in owned.items():
            if destination in files:
                raise OutputError(
                    f"{str(folder / location)!r} is the external data of {str(other)!r}; "
                    f"writing {str(target)!r} there would replace that model's weights: choose "
                    "another output folder (or another output name)")
    kept = []
    for name in companion_writes:
        existing = folder / name
        if existing.exists():
            if name == GENAI_CONFIG:
                foreign = _config_is_foreign(existing, target)
            elif others and companion_sources is not None:
                if _same_bytes(existing, companion_sources / name):
                    continue
                foreign = True
            else:
                foreign = False
            if foreign:
                raise OutputError(
                    f"{str(existing)!r} belongs to another model in {str(folder)!r}; writing "
                    f"{str(target)!r} there would replace it: choose another output folder")
        kept.append(name)
    return kept


def _same_bytes(first: Path, second: Path) -> bool:
    if first.stat().st_size != second.stat().st_size:
        return False
    with first.open("rb") as a, second.open("rb") as b:
        while block := a.read(COPY_BLOCK_BYTES):
            if block != b.read(len(block)):
                return False
    return True


def save_model(
    model: ir.Model,
    path: str | os.PathLike,
    progress: Callable[[int], None] | None = None,
    *,
    companions_from: str | os.PathLike | None = None,
) -> list[str]:
    """Write `model` to `path`, keeping its external data external; return the companions copied.

    External data files are copied block by block into the target folder (`output_locations`
    names them; the tensors' locations are rewritten to match) unless they already are the
    files there, so an in-place rewrite copies no weights. With `companions_from`, the
    COMPANION_FILES found in that folder are copied too (none when it is the target folder);
    a companion must be a plain file inside that folder. A copied genai config names `path`'s
    file as its decoder and is otherwise kept as it is (see `_output_config`). Nothing that
    belongs to another model in the target folder is overwritten (OutputError). Copies keep
    their source's permission bits.

    Everything is staged in a temporary folder beside `path` (with an owner file; staging left
    by a writer that died is removed on the next write of the same target) and renamed into
    place at the end, the .onnx file last; on failure or interruption the staging folder and
    any folder this call created are removed, so no partial output is left. `progress`
    receives the byte count of each block copied. Raises OutputError when the target cannot be
    written.

    Initializers marked with `write_to_data_file` (of at least 1 KiB) are written to a new data
    file, `<target name>.weights.data` (`.weights-2.data`, ... where the model already
    references that name), not inside the .onnx. A copied data file that compacting to the
    tensors the model references makes COMPACT_UNREFERENCED_BYTES (external_data) smaller or
    more (weights a pass replaced) is copied so: each tensor at an offset congruent to its old
    one modulo a page (64 bytes for a tensor smaller than a page), the model's offsets
    rewritten to match. An in-place rewrite copies nothing, so its data file keeps such bytes.
    """
    target = Path(path)
    try:
        with staged_write(target.parent, target.name) as staging:
            return _save_staged(model, target, staging, progress, companions_from)
    except OutputError:  # already says what to do; an OSError too, not to be wrapped
        raise
    except OSError as error:
        raise OutputError(
            f"cannot write {str(target)!r}: {error.strerror or error}; choose a writable "
            "output folder with room for the model"
        ) from error


def _save_staged(model: ir.Model, target: Path, staging: Staging,
                 progress: Callable[[int], None] | None,
                 companions_from: str | os.PathLike | None) -> list[str]:
    """`save_model`'s work once the target folder and the staging folder exist."""
    target_dir = target.parent.resolve()
    resolved_target = target_dir / target.name
    files = external_data_files(model)
    locations = output_locations(files, resolved_target)
    copies = {location: source for location, source in files.items()
              if not ((target_dir / locations[location]).exists()
                      and os.path.samefile(source, target_dir / locations[location]))}
    source_dir = None if companions_from is None else Path(companions_from)
    sources = _companion_sources(companions_from, target_dir)
    marked = _marked_initializers(model)
    weights = (_weights_location(resolved_target, {*locations, *locations.values()})
               if marked else None)
    data_writes = [locations[name] for name in copies] + ([weights] if weights else [])
    companions = _refuse_foreign(resolved_target, data_writes, sources, source_dir)
    config = _output_config(sources, companions_from, resolved_target)
    staged: list[str] = []
    if weights is not None:
        with _in_data_file(marked, staging.path, weights):
            proto = ir.serde.serialize_model(model)
    else:
        proto = ir.serde.serialize_model(model)
    entries = list(external_entries(proto))
    for location, source in copies.items():
        written = locations[location]
        layout = compacted_layout(entries, location, source)
        if layout is None:
            logger.info("copying external data %s -> %s", source, target_dir / written)
            staging.copy(source, written, progress)
        else:
            logger.info("copying the %d referenced ranges of %s -> %s", len(layout), source,
                        target_dir / written)
            (staging.path / written).parent.mkdir(parents=True, exist_ok=True)
            copy_layout(source, staging.path / written, layout, progress)
            move_offsets(proto, location, layout)
        staged.append(written)
    if weights is not None:
        staged.append(weights)
    copied = [name for name in companions if name != GENAI_CONFIG]
    if source_dir is not None:
        for name in copied:
            staging.copy(source_dir / name, name)
    if config is not None:
        _write_config(*config, staging.path / GENAI_CONFIG)
    relocate(proto, locations)
    write_proto(proto, staging.path / target.name)
    written_config = [GENAI_CONFIG] if config is not None else []
    staging.publish([*staged, *copied, *written_config, target.name])
    return companions


def _marked_initializers(model: ir.Model) -> list[ir.Value]:
    """The main graph's in-memory initializers marked with `write_to_data_file` that are large
    enough for the data file, in the graph's order (a layer's weights stay adjacent on disk)."""
    return [value for value in model.graph.initializers.values()
            if value.meta.get(_TO_DATA_FILE) and value.const_value is not None
            and not isinstance(value.const_value, ir.ExternalTensor)
            and value.const_value.nbytes >= _DATA_FILE_THRESHOLD_BYTES]


def _weights_location(target: Path, taken: set[str]) -> str:
    """The new-weights data file's name beside `target`: one the model does not reference."""
    name, count = f"{target.name}.weights.data", 1
    while name in taken:
        count += 1
        name = f"{target.name}.weights-{count}.data"
    return name


@contextlib.contextmanager
def _in_data_file(values: list[ir.Value], folder: Path, location: str) -> Iterator[None]:
    """Within: `values`' tensors written to the data file `location` in `folder` (onnx_ir's
    `convert_tensors_to_external`, offsets past 1 MiB page-aligned) and referenced from it, so
    a model serialized now holds no copy of their bytes; after, the tensors are the in-memory
    ones again (the caller's model stays usable once the staged file has moved)."""
    tensors = [value.const_value for value in values]
    written = ir.external_data.convert_tensors_to_external(
        tensors, folder, location, alignment=_ALIGN_BYTES)  # type: ignore[arg-type]
    try:
        for value, external in zip(values, written):
            value.const_value = external
        yield
    finally:
        for value, tensor in zip(values, tensors):
            value.const_value = tensor
    logger.info("wrote %d new weight tensors to %s", len(values), location)


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


def _companion_sources(source_dir: str | os.PathLike | None, target_dir: Path) -> list[str]:
    """The COMPANION_FILES to copy from `source_dir` (none when it is the target folder).

    Raises ModelLoadError for a companion that is a symlink or not a plain file: like external
    data, a companion must be a file inside the model's folder.
    """
    if source_dir is None or Path(source_dir).resolve() == target_dir:
        return []
    source = Path(source_dir)
    root = source.resolve()
    names = []
    for name in COMPANION_FILES:
        path = source / name
        if not (path.exists() or path.is_symlink()):
            continue
        if path.is_symlink() or not path.is_file() or not path.resolve().is_relative_to(root):
            raise ModelLoadError(
                f"{str(path)!r} is a symlink or not a plain file; companion files are copied "
                "only as plain files inside the model's folder: replace it with the file itself")
        names.append(name)
    return names


def _output_config(companions: list[str], companions_from: str | os.PathLike | None,
                   target: Path) -> tuple[dict, Path] | None:
    """The genai config to write beside `target` and its source, or None when none is copied.

    The copied config names `target`'s file as its decoder; every other setting is kept as the
    source has it. The chunk width is not written as `search.chunk_size`: onnxruntime-genai's
    `og.Engine` with static batching (the only batching a contiguous-KV export runs with)
    refuses every request whose search options carry a chunk size, so the converted folder
    would no longer run where the original ran. The width stays in the model's metadata
    (`runtime_configurable.chunked_prefill.chunk_size`), which onnx-chunk reads first; a
    genai user who wants the same chunks passes `chunk_size` in the generator's search options.
    """
    if GENAI_CONFIG not in companions or companions_from is None:
        return None
    source = Path(companions_from) / GENAI_CONFIG
    document, named = _config_decoder(source)
    updated = json.loads(json.dumps(document))
    if (named or DEFAULT_DECODER) != target.name:
        model = updated.setdefault("model", {})
        model.setdefault("decoder", {})["filename"] = target.name
    return updated, source


def _write_config(config: dict, source: Path, staged: Path) -> None:
    """Write `config` as JSON to `staged`, with `source`'s permission bits."""
    staged.write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
    os.chmod(staged, stat.S_IMODE(source.stat().st_mode))
