"""A model as users name it: an .onnx file, or a folder as onnxruntime-genai takes it.

A folder names its decoder in `genai_config.json` (`model.decoder.filename`), else holds
`model.onnx`, else `chunk.onnx` (a static chunk graph from `fix-shapes`), else a single .onnx
file. A `filename` that leaves the folder is refused, never followed. The config beside a file
applies to that file only when it is the decoder the config names, so a folder holding two
models never lends one model's limits to the other.

Only the standard library is used here: the serving path reads folders too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnx_chunk.errors import ModelLoadError, OutputError

GENAI_CONFIG = "genai_config.json"
# The `search` fields onnx-chunk reads, by the JSON type each must have.
_SEARCH_FLAGS = ("do_sample",)
_SEARCH_NUMBERS = ("temperature", "top_p", "repetition_penalty")
_SEARCH_INTEGERS = ("top_k", "random_seed")
HF_CONFIG = "config.json"
DEFAULT_DECODER = "model.onnx"
STATIC_CHUNK_DECODER = "chunk.onnx"


def check_utf8_path(path: str | os.PathLike,
                    error_type: type[ModelLoadError | OutputError] = ModelLoadError) -> None:
    """`error_type` when `path` is not valid UTF-8 (ONNX Runtime and onnx take UTF-8 only)."""
    try:
        os.fspath(path).encode("utf-8")
    except UnicodeEncodeError as error:
        raise error_type(
            f"the path {os.fsdecode(path)!r} is not valid UTF-8; ONNX Runtime opens UTF-8 "
            "paths only: rename the file or its folder") from error


@dataclass(frozen=True)
class GenaiConfig:
    """What onnx-chunk reads of a `genai_config.json` (every field optional in the file)."""

    path: Path
    filename: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    context_length: int | None = None
    head_size: int | None = None
    max_length: int | None = None
    chunk_size: int | None = None
    search: dict[str, Any] = field(default_factory=dict)
    document: dict[str, Any] = field(default_factory=dict, repr=False)

    def providers(self) -> tuple[str, ...]:
        """The execution providers the export was built for, as genai names them in
        `model.decoder.session_options.provider_options` ("cuda", "dml", ...; none for a CPU
        export, whose list the builder leaves empty)."""
        section: Any = self.document
        for key in ("model", "decoder", "session_options"):
            section = section.get(key) if isinstance(section, dict) else None
        options = section.get("provider_options") if isinstance(section, dict) else None
        if not isinstance(options, list):
            return ()
        return tuple(str(name) for entry in options if isinstance(entry, dict)
                     for name in entry)


@dataclass(frozen=True)
class ModelLocation:
    """The decoder file a user named, its folder, and the genai config that applies to it."""

    onnx_path: Path
    folder: Path
    genai: GenaiConfig | None


def locate_model(path: str | os.PathLike) -> ModelLocation:
    """Resolve MODEL (a file or a folder) to its decoder file; ModelLoadError when impossible."""
    given = Path(path)
    if given.is_dir():
        genai = read_genai_config(given / GENAI_CONFIG)
        return ModelLocation(_decoder_in(given, genai), given, genai)
    folder = given.parent
    genai = read_genai_config(folder / GENAI_CONFIG)
    if genai is not None and (genai.filename or DEFAULT_DECODER) != given.name:
        genai = None
    return ModelLocation(given, folder, genai)


def read_genai_config(path: Path) -> GenaiConfig | None:
    """Read `path` (None when absent); ModelLoadError when it is unreadable or contradicts
    itself."""
    document = read_json_object(path, "the genai config", "onnxruntime-genai's config "
                                "({\"model\": {...}, \"search\": {...}})")
    if document is None:
        return None
    reader = _Reader(path)
    model = reader.section(document, "model")
    decoder = reader.section(model, "decoder")
    search = reader.section(document, "search")
    reader.search_types(search)
    eos = model.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    for value in eos_ids:
        reader.token_id(value, "model.eos_token_id")
    return GenaiConfig(
        path=path,
        filename=reader.string(decoder, "filename", "model.decoder.filename"),
        eos_token_ids=eos_ids,
        pad_token_id=reader.token_id(model.get("pad_token_id"), "model.pad_token_id"),
        bos_token_id=reader.token_id(model.get("bos_token_id"), "model.bos_token_id"),
        context_length=reader.size(model.get("context_length"), "model.context_length"),
        head_size=reader.size(decoder.get("head_size"), "model.decoder.head_size"),
        max_length=reader.size(search.get("max_length"), "search.max_length"),
        chunk_size=reader.size(search.get("chunk_size"), "search.chunk_size"),
        search=dict(search),
        document=document,
    )


def read_max_positions(folder: Path) -> int | None:
    """`max_position_embeddings` of the transformers `config.json` in `folder` (None when the
    file or the key is absent): the longest sequence of an Optimum or torch.onnx export."""
    path = folder / HF_CONFIG
    document = read_json_object(path, "the transformers config", "a transformers config.json")
    if document is None:
        return None
    return _Reader(path).size(document.get("max_position_embeddings"),
                              "max_position_embeddings")


def read_json_object(path: Path, what: str, expected: str) -> dict[str, Any] | None:
    """A JSON object file of a model folder (None when absent); ModelLoadError when it is no
    plain file, unreadable, or holds something else than an object (`expected` says what)."""
    if not path.exists():
        return None
    if path.is_symlink() or not path.is_file():
        raise ModelLoadError(f"{str(path)!r} is not a regular file; {what} must be a "
                             "plain file in the model's folder")
    try:
        document = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ModelLoadError(f"cannot read {str(path)!r} as JSON ({error}); fix or remove "
                             "the file") from error
    except RecursionError as error:
        raise ModelLoadError(f"cannot read {str(path)!r}: its arrays or objects nest too deep "
                             "to be read; fix or remove the file") from error
    if not isinstance(document, dict):
        raise ModelLoadError(f"{str(path)!r} holds no JSON object; expected {expected}")
    return document


def _decoder_in(folder: Path, genai: GenaiConfig | None) -> Path:
    if genai is not None and genai.filename is not None:
        return _inside(folder, genai.filename, genai.path)
    for name in (DEFAULT_DECODER, STATIC_CHUNK_DECODER):
        if (folder / name).is_file():
            return folder / name
    candidates = sorted(folder.glob("*.onnx"))
    if len(candidates) == 1:
        return candidates[0]
    found = ", ".join(candidate.name for candidate in candidates) or "none"
    raise ModelLoadError(
        f"cannot tell which model in the folder {str(folder)!r} to use (.onnx files: {found}; "
        f"no {GENAI_CONFIG} names one); pass the .onnx file itself")


def _inside(folder: Path, filename: str, config: Path) -> Path:
    root = folder.resolve()
    candidate = folder / filename
    if Path(filename).is_absolute() or not candidate.resolve().is_relative_to(root):
        raise ModelLoadError(
            f"{str(config)!r} names the decoder {filename!r}, which lies outside the model's "
            f"folder {str(folder)!r}; a folder's decoder must sit inside it")
    if not candidate.is_file():
        raise ModelLoadError(f"{str(config)!r} names the decoder {filename!r}, which is not a "
                             f"file in {str(folder)!r}")
    return candidate


class _Reader:
    """Typed field reads that name the file and the key on failure."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _fail(self, key: str, expected: str, value: object) -> ModelLoadError:
        return ModelLoadError(f"{str(self.path)!r}: {key} must be {expected}, got {value!r}; "
                              "fix the config")

    def section(self, parent: dict, key: str) -> dict:
        value = parent.get(key, {})
        if not isinstance(value, dict):
            raise self._fail(key, "an object", value)
        return value

    def search_types(self, search: dict) -> None:
        """The `search` fields onnx-chunk reads have their JSON types (ranges are checked
        where they are used: `Sampling.from_search`)."""
        for key in _SEARCH_FLAGS:
            if search.get(key) is not None and not isinstance(search[key], bool):
                raise self._fail(f"search.{key}", "true or false", search[key])
        for key in _SEARCH_NUMBERS:
            value = search.get(key)
            if value is not None and (isinstance(value, bool) or
                                      not isinstance(value, (int, float))):
                raise self._fail(f"search.{key}", "a number", value)
        for key in _SEARCH_INTEGERS:
            value = search.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise self._fail(f"search.{key}", "an integer", value)

    def string(self, parent: dict, key: str, name: str) -> str | None:
        value = parent.get(key)
        if value is not None and not (isinstance(value, str) and value):
            raise self._fail(name, "a file name", value)
        return value

    def token_id(self, value: object, name: str) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self._fail(name, "a non-negative integer token id (or a list of them)", value)
        return value

    def size(self, value: object, name: str) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self._fail(name, "a positive integer", value)
        return value
