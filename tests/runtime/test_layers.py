"""runtime/ imports one way: state <- device <- caches <- runner <- engine <- facade (the facade
layer: facade, loading, options, stats, debug and the package itself). A module imports its
own layer or one below, in every form of import: absolute, from the package
(`from onnx_chunk.runtime import X`) or relative."""

import ast
from pathlib import Path

import onnx_chunk.runtime
from tests.import_scan import typing_only

PACKAGE = Path(onnx_chunk.runtime.__file__).parent
ROOT = "onnx_chunk.runtime"
LAYERS = ("state", "device", "caches", "runner", "engine", "facade")


def _layer(module: str) -> int:
    head = module.split(".")[0]
    return LAYERS.index(head) if head in LAYERS else LAYERS.index("facade")


def _is_module(dotted: str) -> bool:
    """Whether `dotted` (relative to the package) names a module or a subpackage of it."""
    path = PACKAGE.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _relative(dotted: str) -> str | None:
    """`dotted` relative to the package ("__init__" for the package itself), or None when it
    lies outside."""
    if dotted == ROOT:
        return "__init__"
    return dotted[len(ROOT) + 1:] if dotted.startswith(ROOT + ".") else None


def _absolute(node: ast.ImportFrom, package: tuple[str, ...]) -> str:
    """The absolute module an ImportFrom reads from; `package`: the importer's package, its
    parts below onnx_chunk.runtime."""
    if not node.level:
        return node.module or ""
    base = [*ROOT.split("."), *package]
    base = base[:len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports(source: str, package: tuple[str, ...]) -> set[str]:
    """The onnx_chunk.runtime modules `source` imports at run time (not under TYPE_CHECKING),
    relative to the package; `package`: the importer's package, its parts below the runtime."""
    tree = ast.parse(source)
    annotations = typing_only(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in annotations:
            continue
        if isinstance(node, ast.Import):
            found.update(filter(None, (_relative(alias.name) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            module = _relative(_absolute(node, package))
            if module is None:
                continue
            prefix = "" if module == "__init__" else module + "."
            # `from P import name`: the submodule P.name when there is one, else P itself.
            found.update(prefix + alias.name if _is_module(prefix + alias.name) else module
                         for alias in node.names)
    return found


def _edges() -> set[tuple[str, str]]:
    edges = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        package = parts[:-1]
        module = ".".join(part for part in parts if part != "__init__") or "__init__"
        edges.update((module, imported) for imported in _imports(path.read_text(), package))
    return edges


def test_runtime_imports_point_down_the_layers():
    upward = sorted((importer, imported) for importer, imported in _edges()
                    if _layer(imported) > _layer(importer))
    assert not upward, f"imports that point up the layers {LAYERS}: {upward}"


def test_the_runner_and_the_engine_no_longer_import_each_other_both_ways():
    edges = _edges()
    assert not any(importer.startswith("runner.") and imported.startswith("engine.")
                   for importer, imported in edges)
    assert any(importer.startswith("engine.") and imported.startswith("runner.")
               for importer, imported in edges)


def test_every_form_of_import_is_seen():
    source = """
from typing import TYPE_CHECKING
import onnx_chunk.runtime
from onnx_chunk.runtime import Runtime
from onnx_chunk.runtime import stats
from onnx_chunk.runtime.engine import counters
from onnx_chunk.runtime.engine.request import Request
from . import model_runner
from .forward import Forward
from .. import options
from ..caches.variant_cache import VariantCache
from ..state import ports
import numpy
if TYPE_CHECKING:
    from onnx_chunk.runtime.facade import Runtime
"""
    assert _imports(source, ("runner",)) == {
        "__init__", "stats", "engine.counters", "engine.request", "runner.model_runner",
        "runner.forward", "options", "caches.variant_cache", "state.ports"}


def test_an_upward_import_in_any_form_is_caught():
    for source in ("from onnx_chunk.runtime import Runtime", "from .. import stats",
                   "from ..engine import sequence", "from ..runner.slot import Slot",
                   "import onnx_chunk.runtime.stats"):
        imported = _imports(source, ("device",))
        assert imported and all(_layer(module) > _layer("device") for module in imported), \
            source


def test_the_text_layer_reads_the_engine_layer_and_below():
    """onnx_chunk.text sits on the runtime: it imports runtime modules of the engine layer and
    below at run time (Runtime only for annotations); the runtime imports nothing of it
    (tests/test_package_imports.py)."""
    text = PACKAGE.parent / "text"
    reached = {imported for path in text.rglob("*.py")
               for imported in _imports(path.read_text(), ("text",))}
    assert reached and all(_layer(module) <= _layer("engine") for module in reached), reached
