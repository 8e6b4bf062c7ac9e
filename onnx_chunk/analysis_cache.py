"""The chunked-prefill plan of an unconverted decoder, analysed once per model file.

A converted model carries its plan in its metadata; an unconverted one (a genai folder run as
it is) is analysed by the passes at every load, which imports onnx and onnx_ir and walks the
graph: most of a cold start. The metadata the passes would write is kept here instead, and a
later load of the same file reads it back as a converted model's (`read_plan`), with neither
library imported.

Rules:
1. The key is the resolved path, device, inode, size, modification and change times
   (nanoseconds) of the model file and of each external data file it names, the chunk size
   asked for, and this onnx-chunk's version and metadata schema: a file changed in place (its
   times) or replaced (its inode) gets another key, so its analysis is never reused.
2. The entry is that metadata as JSON. An entry that cannot be read or parsed, or whose plan
   `read_plan` refuses, is analysed again and written over.
3. An entry is written whole: a temporary file in the same folder renamed over it, so a
   concurrent start never reads half of one. A folder that cannot be written leaves the
   analysis in memory (logged), never an error.
4. The folder: $ONNX_CHUNK_ANALYSIS_CACHE, else the user's cache folder ($XDG_CACHE_HOME or
   ~/.cache; %LOCALAPPDATA% on Windows) / onnx-chunk / analysis.
   ONNX_CHUNK_ANALYSIS_CACHE=off switches the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from onnx_chunk import __version__
from onnx_chunk.errors import ModelStructureError
from onnx_chunk.graph.chunk_plan import ChunkPlan
from onnx_chunk.graph.metadata import SCHEMA_VERSION, read_plan

logger = logging.getLogger(__name__)

ENV = "ONNX_CHUNK_ANALYSIS_CACHE"
OFF = "off"


def cache_folder() -> Path | None:
    """The folder of the entries (rule 4), or None when the cache is off."""
    given = os.environ.get(ENV)
    if given == OFF:
        return None
    if given:
        return Path(given)
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        root = Path(os.environ["LOCALAPPDATA"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "onnx-chunk" / "analysis"


def _identity(path: Path) -> list[object]:
    status = path.stat()
    return [str(path.resolve()), status.st_dev, status.st_ino, status.st_size,
            status.st_mtime_ns, status.st_ctime_ns]


def entry_key(model_path: Path, chunk_size: int | None,
              data_files: Iterable[Path] = ()) -> str:
    """The key of `model_path`'s entry (rule 1)."""
    identity = [_identity(model_path), sorted(_identity(path) for path in set(data_files)),
                chunk_size, __version__, SCHEMA_VERSION]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()


def cached_plan(model_path: Path, chunk_size: int | None,
                analyze: Callable[[], Mapping[str, str]],
                data_files: Iterable[Path] = ()) -> ChunkPlan:
    """The plan of `model_path` (whose external data is in `data_files`) from its entry, else
    from `analyze()` (the metadata the passes would write), whose result is then stored (rules
    2 and 3)."""
    folder = cache_folder()
    try:
        key = None if folder is None else entry_key(model_path, chunk_size, data_files)
    except OSError as error:  # a data file gone: the analysis (and the load) say why
        logger.info("no analysis entry for %s (%s)", model_path, error)
        key = None
    path = None if folder is None or key is None else folder / f"{key}.json"
    if path is not None:
        plan = _read(path)
        if plan is not None:
            logger.info("%s: the analysis of an earlier load, from %s", model_path, path)
            return plan
    props = dict(analyze())
    plan = read_plan(props)
    if plan is None:
        raise ModelStructureError(f"the passes wrote no plan for {str(model_path)!r}")
    if path is not None:
        _write(path, props)
    return plan


def _read(path: Path) -> ChunkPlan | None:
    try:
        props = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(props, dict) or not all(
                isinstance(key, str) and isinstance(value, str) for key, value in props.items()):
            raise ValueError("not a mapping of strings")
        return read_plan(props)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, ModelStructureError) as error:
        logger.info("ignoring the analysis entry %s (%s); analysing again", path, error)
        return None


def _write(path: Path, props: Mapping[str, str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-",
                                        suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                json.dump(dict(props), file, sort_keys=True)
            os.replace(name, path)
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise
    except OSError as error:
        logger.info("cannot keep the analysis in %s (%s); it stays in memory", path.parent,
                    error)
