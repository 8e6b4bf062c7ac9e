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
