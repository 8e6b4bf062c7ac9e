"""The repository's own promises: CI runs exactly the README's two commands."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_commands():
    readme_commands = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()
                       if line.strip().startswith("python3 -m venv")]
    ci_commands = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
                   if line.strip().startswith("python3 -m venv")]
    assert any("pytest" in command for command in readme_commands), "README names no tests"
    assert any("onnx-chunk demo" in command for command in readme_commands)
    assert ci_commands == readme_commands[:2]


def test_the_readme_is_short_and_every_link_in_it_resolves():
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode("utf-8")) < 10_000
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links, "the README links to no documentation"
    local = [link.split("#")[0] for link in links if "://" not in link and link.split("#")[0]]
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


# Documents a reader of this repository does not have; say the behaviour in our own words.
_FOREIGN = r"seed[ -]?00\d|reference documents?|DESIGN\.md|design facts?\b"
# Owned by the runtime's restructuring; their references are removed there.
_NOT_YET = ("docs/validate.md", "docs/static_graph.md", "docs/serving.md")


def test_no_reference_to_documents_the_reader_does_not_have():
    import re

    pattern = re.compile(_FOREIGN, re.IGNORECASE)
    files = [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("onnx_chunk", "scripts", "tests", ".ci"):
        files += sorted(path for path in (ROOT / folder).rglob("*")
                        if path.is_file() and path.suffix in {".py", ".md", ".sh", ""}
                        and "fixtures" not in path.parts and "__pycache__" not in path.parts)
    found = []
    for path in files:
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(_NOT_YET) or relative == "tests/test_repo.py":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_every_module_of_the_package_is_at_most_500_lines():
    package = ROOT / "onnx_chunk"
    longer = {str(path.relative_to(package)): lines for path in sorted(package.rglob("*.py"))
              if (lines := len(path.read_text(encoding="utf-8").splitlines())) > 500}
    assert not longer, f"modules over 500 lines (split them along their concepts): {longer}"


def test_every_onnx_chunk_import_in_ci_and_docs_resolves():
    """CI's shell scripts and the docs' snippets import the package outside pytest's collection:
    a module moved in the package leaves them broken until CI's last step (.ci/repeat_path
    imported onnx_chunk.query_seqlens after it moved under onnx_chunk.graph)."""
    import importlib
    import re

    pattern = re.compile(r"from (onnx_chunk(?:\.\w+)*) import \(?([\w, ]+)")
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted(path for path in (ROOT / ".ci").iterdir() if path.is_file()),
             *sorted((ROOT / "scripts").glob("*.sh"))]
    broken = []
    for path in files:
        for module, names in pattern.findall(path.read_text(encoding="utf-8")):
            where = f"{path.relative_to(ROOT).as_posix()}: from {module} import {names.strip()}"
            try:
                imported = importlib.import_module(module)
            except ImportError as error:
                broken.append(f"{where} ({error})")
                continue
            for name in (part.strip() for part in names.split(",")):
                if name and not hasattr(imported, name):
                    try:
                        importlib.import_module(f"{module}.{name}")
                    except ImportError:
                        broken.append(f"{where} (no {name})")
    assert not broken, "\n".join(broken)
