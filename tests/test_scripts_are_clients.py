"""Scripts are clients: every script under scripts/ (scripts/_bench/ included), and every child
program a script runs from a string (`python -c SOURCE`), reaches the runtime as users do,
through the facade (the names of `onnx_chunk.runtime.__all__`), and looks inside it only
through `runtime.debug` and the `onnx_chunk.runtime.debug` module (docs/runtime.md, "Looking
inside"). Nothing else under `onnx_chunk.runtime`, no private module of onnx_chunk
(`onnx_chunk._name`) and no private name is imported or read: a refactoring of the runtime's
insides then breaks no script.

Every form is seen: `import M`, `import M as alias`, `from M import name`, an attribute chain
on an imported module (`onnx_chunk.runtime.caches.x`, `rt.caches` after `import
onnx_chunk.runtime as rt`), a module named in a string ("onnx_chunk.runtime.facade", as
`importlib.import_module` takes it), and all of those inside a child program's source."""

import ast
import re
from pathlib import Path

import onnx_chunk
import onnx_chunk.runtime

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
RUNTIME = "onnx_chunk.runtime"
# The one module under the runtime beside the facade that a script may import.
DEBUG = "debug"
MODULE_PATH = re.compile(r"onnx_chunk(\.\w+)+")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_problem(module: str) -> str | None:
    """Why importing the onnx_chunk module `module` is not a client's import (None: it is)."""
    parts = module.split(".")
    if parts[0] != "onnx_chunk":
        return None
    if any(_is_private(part) for part in parts):
        return "a private module"
    if parts[:2] == ["onnx_chunk", "runtime"] and len(parts) > 2 and parts[2] != DEBUG:
        return "the runtime's insides (use the facade or runtime.debug)"
    return None


def _name_problem(module: str, name: str) -> str | None:
    """Why `from module import name` (or `module.name`) is not a client's (None: it is)."""
    if _is_private(name):
        return "a private name or module"
    if module == RUNTIME and name not in onnx_chunk.runtime.__all__ and name != DEBUG:
        return "not a name of the runtime's facade"
    return None


def _dotted(node: ast.expr) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _bound_modules(tree: ast.AST) -> dict[str, str]:
    """The names a source binds to onnx_chunk modules: `import onnx_chunk.x` binds onnx_chunk,
    `import onnx_chunk.x as y` binds y to onnx_chunk.x, `from onnx_chunk import runtime` binds
    runtime to onnx_chunk.runtime."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "onnx_chunk":
                    bound[alias.asname or "onnx_chunk"] = alias.name if alias.asname else \
                        "onnx_chunk"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("onnx_chunk"):
            for alias in node.names:
                if alias.name in ("runtime", DEBUG):
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _child_programs(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, source) of the Python programs a source holds in its multi-line strings (a
    child's `-c` source)."""
    programs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value:
            try:
                program = ast.parse(node.value)
            except SyntaxError:
                continue
            if any(isinstance(each, (ast.Import, ast.ImportFrom)) for each in ast.walk(program)):
                programs.append((node.lineno, node.value))
    return programs


def _attribute_problem(parts: list[str], bound: dict[str, str]) -> str | None:
    module = bound.get(parts[0])
    if module is None:
        return None
    full = module.split(".") + parts[1:]
    # onnx_chunk.runtime.NAME...: NAME is the facade's; onnx_chunk._x: a private module.
    for depth in range(2, len(full) + 1):
        owner, name = ".".join(full[:depth - 1]), full[depth - 1]
        if owner == RUNTIME or owner.startswith(RUNTIME + "."):
            return _name_problem(RUNTIME, name) if owner == RUNTIME else None
        if _is_private(name):
            return "a private module" if owner == "onnx_chunk" else "a private name"
    return None


def client_problems(source: str, first_line: int = 0) -> list[tuple[int, str, str]]:
    """(line, what, why) of every import or read in `source` that is not a client's."""
    tree = ast.parse(source)
    bound = _bound_modules(tree)
    # An attribute chain is judged whole, at its outermost attribute.
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    found = []
    for node in ast.walk(tree):
        line = first_line + node.lineno if hasattr(node, "lineno") else first_line
        if isinstance(node, ast.Import):
            found += [(line, f"import {alias.name}", why) for alias in node.names
                      if (why := _module_problem(alias.name))]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("onnx_chunk"):
            module = node.module or ""
            why = _module_problem(module)
            if why:
                found.append((line, f"from {module} import ...", why))
                continue
            found += [(line, f"from {module} import {alias.name}", why) for alias in node.names
                      if (why := _name_problem(module, alias.name))]
        elif (isinstance(node, ast.Attribute) and id(node) not in inner
              and (parts := _dotted(node))):
            if why := _attribute_problem(parts, bound):
                found.append((line, ".".join(parts), why))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and MODULE_PATH.fullmatch(node.value)):
            if why := _module_problem(node.value):
                found.append((line, repr(node.value), why))
    for line, program in _child_programs(tree):
        found += client_problems(program, first_line + line - 1)
    return sorted(set(found))


def _scripts() -> list[Path]:
    return sorted(SCRIPTS.rglob("*.py"))


def test_scripts_reach_the_runtime_through_its_facade_and_debug_only():
    problems = [f"{path.relative_to(ROOT)}:{line}: {what} ({why})"
                for path in _scripts()
                for line, what, why in client_problems(path.read_text())]
    assert not problems, "scripts that are not clients of the public API:\n" + "\n".join(problems)


def test_the_rule_sees_every_form():
    source = '''
import onnx_chunk
import onnx_chunk.runtime as rt
from onnx_chunk import load, Sampling, _onnxruntime_wheels
from onnx_chunk.runtime import Runtime, RuntimeOptions, facade, debug
from onnx_chunk.runtime.debug import RuntimeDebug
from onnx_chunk.runtime.device.provider import MaskPolicy
from onnx_chunk.runtime.caches import variant_pool
import onnx_chunk.runtime.engine.batch_engine
from onnx_chunk.models import build_decoder
from onnx_chunk.sampling import _private_helper
rt.load(path)
rt.caches.variant_cache
onnx_chunk.runtime.Sequence
onnx_chunk.runtime.runner.model_runner
onnx_chunk._onnxruntime_wheels.check_one_wheel()
importlib.import_module("onnx_chunk.runtime.facade")
CHILD = """
import onnx_chunk
from onnx_chunk.runtime.engine import batch_engine
"""
'''
    assert [what for _, what, _ in client_problems(source)] == [
        "from onnx_chunk import _onnxruntime_wheels",
        "from onnx_chunk.runtime import facade",
        "from onnx_chunk.runtime.device.provider import ...",
        "from onnx_chunk.runtime.caches import ...",
        "import onnx_chunk.runtime.engine.batch_engine",
        "from onnx_chunk.sampling import _private_helper",
        "rt.caches.variant_cache",
        "onnx_chunk.runtime.runner.model_runner",
        "onnx_chunk._onnxruntime_wheels.check_one_wheel",
        "'onnx_chunk.runtime.facade'",
        "from onnx_chunk.runtime.engine import ...",
    ]
