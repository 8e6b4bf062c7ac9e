"""What the CLI's promise looks like from a test: one `error:` line on stderr, no traceback."""


def one_error_line(capsys, *words: str) -> str:
    """Assert stderr holds exactly one `error:` line with each of `words`; return it."""
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    for word in words:
        assert word in err[0], err[0]
    return err[0]
