"""The example in docs/runtime.md runs as written."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"


def test_the_documented_example_runs(capsys):
    example = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    exec(compile(example, str(DOC), "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[1:] == ["128", "(43,", "86,", "128)"]
    assert len(lines[1].split()) == 8
    assert lines[2] == "[(128, 128), (128, 128), (44, 86)]"
