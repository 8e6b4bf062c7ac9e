"""What the CLI's promise looks like from a test: one `error:` line on stderr, no traceback;
and a `validate` run that passes every check."""

import json

from onnx_chunk.cli import main


def one_error_line(capsys, *words: str) -> str:
    """Assert stderr holds exactly one `error:` line with each of `words`; return it."""
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    for word in words:
        assert word in err[0], err[0]
    return err[0]


def validate_passes(capsys, model, lengths: str, new_tokens: int = 3) -> dict:
    """Run `validate --json` on CPU; assert exit 0, no failed check and the checker passed."""
    capsys.readouterr()
    code = main(["validate", str(model), "--provider", "cpu", "--json", "--lengths", lengths,
                 "--new-tokens", str(new_tokens)])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    failed = [check for check in report["checks"] if check["outcome"] == "failed"]
    assert code == 0 and not failed, failed or captured.err
    checker = next(check for check in report["checks"] if check["name"] == "structure.checker")
    assert checker["outcome"] == "passed"
    return report
