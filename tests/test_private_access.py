"""Tests use what they test through its public names: no test reads (or sets) a private name of
another object (`x._name` where x is not `self` or `cls`; dunders such as `__name__` are public),
imports one (`from module import _name`), or names one in a string to wrap or read it: the
dotted target of `monkeypatch.setattr`/`delattr` or `mock.patch` ("module._name"), or an object
followed by a private name (`monkeypatch.setattr(x, "_name", ...)`, `patch.object(x, "_name")`,
`getattr(x, "_name")`, a test's own helper that wraps `x._name`).

A test that must look inside a runtime reads `runtime.debug` (docs/runtime.md); a seam a test
wraps (a function it monkeypatches) has a public name in its module.

A module whose own file is named with a leading underscore (`scripts/_bench/`,
`onnx_chunk/_onnxruntime_wheels.py`, `tests/models/_ort.py`) is the internal home of what it holds,
so a test may import it whole or name it in `from package import _module`, but the underscored
names inside any module are that module's private API and stay out of reach."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# Where an absolute import is looked up: the repository, and scripts/ (which bench tests put on
# sys.path to import `_bench`).
IMPORT_ROOTS = (ROOT, ROOT / "scripts")
# Methods that take one dotted "module.name" target as their first argument, as `patch` does.
TARGET_METHODS = ("setattr", "delattr")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _module_folders(node: ast.ImportFrom, path: Path) -> list[Path]:
    """The folders `node`'s module may be: relative to `path`, or under each import root."""
    parts = node.module.split(".") if node.module else []
    if node.level:
        base = path.parent
        for _ in range(node.level - 1):
            base = base.parent
        return [base.joinpath(*parts)]
    return [root.joinpath(*parts) for root in IMPORT_ROOTS]


def _is_module(folder: Path, name: str) -> bool:
    return (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file()


def _private_import(node: ast.ImportFrom, path: Path) -> list[str]:
    """The private names (not modules) `from M import ...` takes out of M."""
    folders = _module_folders(node, path)
    return [f"from {'.' * node.level}{node.module or ''} import {alias.name}"
            for alias in node.names
            if _is_private(alias.name)
            and not any(_is_module(folder, alias.name) for folder in folders)]


def _string(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _private_attribute(name: str | None) -> bool:
    return name is not None and name.isidentifier() and _is_private(name)


def _named_attributes(call: ast.Call) -> list[tuple[ast.expr | None, str]]:
    """(the object, or None for a dotted target; the attribute's name, or the target) of each
    private attribute `call` names by string: a dotted target of `monkeypatch.setattr`,
    `monkeypatch.delattr` or `patch`, and any object followed by a private name in a string
    (`setattr(x, "_name", ...)`, `patch.object(x, "_name")`, a test's helper wrapping
    `x._name`), keyword arguments included."""
    found: list[tuple[ast.expr | None, str]] = []
    function = call.func
    called = (function.attr if isinstance(function, ast.Attribute)
              else function.id if isinstance(function, ast.Name) else "")
    dotted = called == "patch" or called in TARGET_METHODS and isinstance(function, ast.Attribute)
    first = call.args[0] if call.args else next(
        (named.value for named in call.keywords if named.arg == "target"), None)
    target = _string(first)
    if dotted and target is not None and "." in target:
        if _private_attribute(target.rsplit(".", 1)[-1]):
            found.append((None, target))
    found.extend((owner, name) for owner, argument in zip(call.args, call.args[1:])
                 if _string(owner) is None and _private_attribute(name := _string(argument)))
    named = [keyword for keyword in call.keywords if _private_attribute(_string(keyword.value))]
    if named and first is not None and _string(first) is None:
        found.extend((first, _string(keyword.value)) for keyword in named)
    return found


def _private_wraps(call: ast.Call) -> list[str]:
    """`call` as text, once for each private attribute of another object it names by string."""
    return [f"{ast.unparse(call.func)}("
            f"{repr(name) if owner is None else f'{ast.unparse(owner)}, {name!r}'}, ...)"
            for owner, name in _named_attributes(call)
            if owner is None or not _is_self(owner)]


def _private_uses(source: str, path: Path = TESTS / "test_example.py") -> list[tuple[int, str]]:
    """(line, expression) of every private name of another object that `source` (the text of
    the file at `path`) reads, sets, imports or wraps by name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and not _is_self(node.value):
            found.append((node.lineno, node.col_offset, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            found.extend((node.lineno, node.col_offset, text)
                         for text in _private_import(node, path))
        elif isinstance(node, ast.Call):
            found.extend((node.lineno, node.col_offset, text) for text in _private_wraps(node))
    return [(line, expression) for line, _, expression in sorted(found)]


def _checked_files() -> list[Path]:
    return sorted(TESTS.rglob("*.py"))


def test_no_test_reads_a_private_name_of_another_object():
    uses = [f"{path.relative_to(ROOT)}:{line}: {expression}"
            for path in _checked_files()
            for line, expression in _private_uses(path.read_text(), path)]
    assert not uses, "private names used from outside their object:\n" + "\n".join(uses)


def test_the_rule_sees_every_form_and_spares_its_own_object():
    source = """
runtime.debug.engine._batch
module._helper()
Thing._create = None
load(path)._options
self._kept
cls._registry
value.__class__
from onnx_chunk.serve.app import _error_answer
from onnx_chunk.serve.app import build_app, _Helper as Helper
from .test_audit import _Held
from onnx_chunk import __version__
from scripts import _bench
from scripts._bench import environment
from _bench import text_decoder
from .models import _ort
from onnx_chunk._onnxruntime_wheels import check_one_wheel
import onnx_chunk._onnxruntime_wheels
monkeypatch.setattr(memory, "_CUDART_NAMES", ())
monkeypatch.setattr("onnx_chunk.graph.model_io._copy_file", copy)
monkeypatch.delattr(memory, "_cache", raising=False)
monkeypatch.delattr("onnx_chunk.runtime.memory._cache")
patch.setattr(type(runner), "_run", run)
mock.patch("onnx_chunk.graph.model_io._write_proto")
patch("onnx_chunk.graph.model_io._write_proto", side_effect=OSError)
patch.object(ModelRunner, "_save_windows")
mock.patch.object(target=ModelRunner, attribute="_save_windows")
setattr(runner, "_windows", [])
getattr(runner, "_windows")
monkeypatch.setattr(memory, "cudart", fake)
monkeypatch.setattr("sys.stdin", stream)
monkeypatch.setattr(self, "_kept", None)
patch.object(ModelRunner, "__call__")
setattr(self, "_kept", None)
_Held(monkeypatch, type(service), "_whole")
_Held(monkeypatch, type(service), "whole_json")
name.replace("_out", "_in")
name.endswith("_KEY")
"""
    assert [expression for _, expression in _private_uses(source)] == [
        "runtime.debug.engine._batch", "module._helper", "Thing._create", "load(path)._options",
        "from onnx_chunk.serve.app import _error_answer",
        "from onnx_chunk.serve.app import _Helper",
        "from .test_audit import _Held",
        "monkeypatch.setattr(memory, '_CUDART_NAMES', ...)",
        "monkeypatch.setattr('onnx_chunk.graph.model_io._copy_file', ...)",
        "monkeypatch.delattr(memory, '_cache', ...)",
        "monkeypatch.delattr('onnx_chunk.runtime.memory._cache', ...)",
        "patch.setattr(type(runner), '_run', ...)",
        "mock.patch('onnx_chunk.graph.model_io._write_proto', ...)",
        "patch('onnx_chunk.graph.model_io._write_proto', ...)",
        "patch.object(ModelRunner, '_save_windows', ...)",
        "mock.patch.object(ModelRunner, '_save_windows', ...)",
        "setattr(runner, '_windows', ...)",
        "getattr(runner, '_windows', ...)",
        "_Held(type(service), '_whole', ...)"]
