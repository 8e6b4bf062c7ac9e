"""runtime/ imports one way: state <- device <- caches <- runner <- engine <- model (the model
layer: model, options, stats and the package itself). A module imports its own layer or one
below; the edges that still point up are listed, each with why, and the list may only shrink."""

import ast
from pathlib import Path

import onnx_chunk.runtime

PACKAGE = Path(onnx_chunk.runtime.__file__).parent
PREFIX = "onnx_chunk.runtime."
LAYERS = ("state", "device", "caches", "runner", "engine", "model")

# (importer, imported) edges that point up today, and why they are left.
KNOWN_UPWARD = {
    # BatchBuffers allocates from runner.ports' BufferPort (device/ is helper cuda's).
    ("device.buffers", "runner.ports"),
    # The session factory builds the row-selecting sessions of runner.logits_row.
    ("device.session_factory", "runner.logits_row"),
    # The engine's counters live in stats.py, which also reads engine.sequence_pool.PoolStats.
    ("engine.batch_engine", "stats"),
    ("engine.sequence", "stats"),
}


def _layer(module: str) -> int:
    head = module.split(".")[0]
    return LAYERS.index(head) if head in LAYERS else LAYERS.index("model")


def _imports(path: Path) -> set[str]:
    """The onnx_chunk.runtime modules `path` imports at run time (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for branch in ast.walk(tree) if isinstance(branch, ast.If)
                   and isinstance(branch.test, ast.Name) and branch.test.id == "TYPE_CHECKING"
                   for statement in branch.body for node in ast.walk(statement)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                 else [alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [])
        found.update(name[len(PREFIX):] for name in names if name.startswith(PREFIX))
    return found


def _edges() -> set[tuple[str, str]]:
    edges = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        module = ".".join(part for part in parts if part != "__init__") or "__init__"
        edges.update((module, imported) for imported in _imports(path))
    return edges


def test_runtime_imports_point_down_the_layers():
    upward = {(importer, imported) for importer, imported in _edges()
              if _layer(imported) > _layer(importer)}
    assert upward <= KNOWN_UPWARD, f"new upward imports: {sorted(upward - KNOWN_UPWARD)}"
    assert upward == KNOWN_UPWARD, f"fixed, take them off the list: {KNOWN_UPWARD - upward}"


def test_the_runner_and_the_engine_no_longer_import_each_other_both_ways():
    edges = _edges()
    assert not any(importer.startswith("runner.") and imported.startswith("engine.")
                   for importer, imported in edges)
    assert any(importer.startswith("engine.") and imported.startswith("runner.")
               for importer, imported in edges)
