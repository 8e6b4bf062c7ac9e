"""Tests use what they test through its public names: no test reads (or sets) a private name of
another object (`x._name` where x is not `self` or `cls`; dunders such as `__name__` are public).

A test that must look inside a runtime reads `runtime.debug` (docs/runtime.md); a seam a test
wraps (a function it monkeypatches) has a public name in its module."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _private_reads(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every `x._name` in `source` whose `x` is not self or cls."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append((node.lineno, node.col_offset, ast.unparse(node)))
    return [(line, expression) for line, _, expression in sorted(found)]


def _checked_files() -> list[Path]:
    return sorted(TESTS.rglob("*.py"))


def test_no_test_reads_a_private_name_of_another_object():
    reads = [f"{path.relative_to(TESTS.parent)}:{line}: {expression}"
             for path in _checked_files()
             for line, expression in _private_reads(path.read_text())]
    assert not reads, "private names read from outside their object:\n" + "\n".join(reads)


def test_the_rule_sees_every_form_and_spares_its_own_object():
    source = """
runtime.debug.engine._batch
module._helper()
Thing._create = None
load(path)._options
self._kept
cls._registry
value.__class__
"""
    assert [expression for _, expression in _private_reads(source)] == [
        "runtime.debug.engine._batch", "module._helper", "Thing._create", "load(path)._options"]

