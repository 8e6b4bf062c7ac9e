"""No import circle between two packages of onnx_chunk, lazy imports included.

A package is a folder of onnx_chunk (runtime, text, serve, ...) and a module at its top
(ladder.py, sampling.py, ...) is its own; `onnx_chunk/__init__.py`, the facade, is the package
`onnx_chunk`. Every import that runs counts: at module level, inside a function or a method
(a lazy import), absolute or relative, and `importlib.import_module` of a literal name; only
imports under `if TYPE_CHECKING:` (annotations, never run) do not. The packages are compared
twice: each top-level one whole (runtime with all its folders), and each folder on its own
(runtime.engine, runtime.device, ...), so neither two subsystems nor two folders of one lean
on each other both ways.
"""

import ast
import functools
from pathlib import Path

import onnx_chunk
from tests.import_scan import typing_only

PACKAGE = Path(onnx_chunk.__file__).parent
ROOT = "onnx_chunk"


def _package(module: str, *, whole: bool) -> str:
    """The package `module` (dotted, below onnx_chunk, or "" for the facade) belongs to:
    `whole`: its top-level folder (or itself at the top); else its own folder."""
    parts = module.split(".") if module else []
    while parts and not (PACKAGE.joinpath(*parts) / "__init__.py").is_file():
        if len(parts) == 1 and PACKAGE.joinpath(parts[0] + ".py").is_file():
            return parts[0]  # a top-level module is its own package
        parts.pop()
    if not parts:
        return ROOT
    return parts[0] if whole else ".".join(parts)


def _below_root(dotted: str) -> str | None:
    if dotted == ROOT:
        return ""
    return dotted[len(ROOT) + 1:] if dotted.startswith(ROOT + ".") else None


def imported_modules(source: str, importer: str, *, is_package: bool) -> set[str]:
    """The onnx_chunk modules (dotted, below onnx_chunk; "" for the facade) that `source`, the
    module `importer`, imports when it runs, wherever the import stands."""
    tree = ast.parse(source)
    skipped = typing_only(tree)
    here = importer.split(".") if importer else []
    base = here if is_package else here[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(name for alias in node.names
                         if (name := _below_root(alias.name)) is not None)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base[:len(base) - (node.level - 1)] + (
                    node.module.split(".") if node.module else [])
                module: str | None = ".".join(parts)
            else:
                module = _below_root(node.module or "")
            if module is None:
                continue
            for alias in node.names:  # `from P import name`: the submodule P.name if any
                child = f"{module}.{alias.name}" if module else alias.name
                path = PACKAGE.joinpath(*child.split("."))
                found.add(child if path.with_suffix(".py").is_file() or path.is_dir()
                          else module)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.func, ast.Attribute | ast.Name)
              and (node.func.attr if isinstance(node.func, ast.Attribute)
                   else node.func.id) == "import_module"
              and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            name = _below_root(node.args[0].value)
            if name is not None:
                found.add(name)
    return found


@functools.cache
def _every_import() -> tuple[tuple[Path, str, frozenset[str]], ...]:
    """Each file of onnx_chunk, its module, and the modules it imports when it runs."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        found.append((path, module, frozenset(
            imported_modules(path.read_text(), module, is_package=is_package))))
    return tuple(found)


def package_edges(*, whole: bool) -> dict[tuple[str, str], list[str]]:
    """(importer's package, imported package) -> the imports that make the edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path, module, imports in _every_import():
        source = _package(module, whole=whole)
        for imported in sorted(imports):
            target = _package(imported, whole=whole)
            if target != source:
                edges.setdefault((source, target), []).append(
                    f"{path.relative_to(PACKAGE.parent)} imports {ROOT}.{imported}".rstrip("."))
    return edges


def circles(edges) -> list[list[str]]:
    """The strongly connected groups of more than one package (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
        graph.setdefault(target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for after in sorted(graph[node]):
            if after not in index:
                visit(after)
                low[node] = min(low[node], low[after])
            elif after in stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _explained(edges, groups) -> str:
    return "; ".join(f"{source} -> {target} ({', '.join(edges[source, target][:3])})"
                     for group in groups for source, target in sorted(edges)
                     if source in group and target in group)


def test_no_import_circle_between_two_top_level_packages():
    edges = package_edges(whole=True)
    groups = circles(edges)
    assert not groups, f"import circles {groups}: {_explained(edges, groups)}"
    # The text layer sits on the runtime; the runtime imports nothing of it.
    assert ("text", "runtime") in edges and ("runtime", "text") not in edges
    # The decoder's file and the edits of its graph lie below both the passes and the runtime.
    assert ("passes", "graph") in edges and ("runtime", "graph") in edges
    assert {target for source, target in edges if source == "graph"} <= {"errors",
                                                                         "staged_output"}


def test_no_import_circle_between_two_folders():
    edges = package_edges(whole=False)
    groups = circles(edges)
    assert not groups, f"import circles {groups}: {_explained(edges, groups)}"


def test_a_lazy_or_relative_import_is_seen_and_an_annotation_is_not():
    source = """
from typing import TYPE_CHECKING
import importlib
from . import generation
from ..runtime.engine import request
if TYPE_CHECKING:
    from onnx_chunk.serve.app import Service
def late():
    from onnx_chunk.text.tokenizer import Tokenizer
    import onnx_chunk.ladder
    return importlib.import_module("onnx_chunk.passes")
class Lazy:
    def method(self):
        from onnx_chunk import errors, __version__
"""
    assert imported_modules(source, "text.conversation", is_package=False) == {
        "text.generation", "runtime.engine.request", "text.tokenizer", "ladder", "passes",
        "errors", ""}


def test_a_circle_closed_by_a_lazy_import_is_found():
    edges = {("runtime", "ladder"): [], ("text", "runtime"): [], ("runtime", "text"): []}
    assert circles(edges) == [["runtime", "text"]]
    assert circles({("text", "runtime"): [], ("runtime", "ladder"): []}) == []
