"""The CLI's promise: every failure is one line on stderr and a non-zero exit, no traceback."""

import pytest

from onnx_chunk.cli import main


@pytest.mark.parametrize("argv", [
    ["no-such-command"],
    ["build-model"],
    ["build-model", "tiny", "-o", "x", "--layers", "many"],
    ["inspect"],
])
def test_usage_errors_are_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err


def test_help_exits_zero(capsys):
    assert main(["--help"]) == 0
    assert "build-model" in capsys.readouterr().out
