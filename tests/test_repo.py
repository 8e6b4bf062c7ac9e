"""The repository's own promises: CI runs exactly the README's test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme_commands = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()
                       if "pytest" in line and line.strip().startswith("python3 -m venv")]
    ci_commands = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
                   if "pytest" in line]
    assert readme_commands, "README.md names no test command"
    assert ci_commands == readme_commands[:1]
