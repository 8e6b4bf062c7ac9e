"""Progress displays: on stderr when it is a terminal, never with --quiet or when piped, and
counting the real bytes of the long parts (hashing and copying weights)."""

from __future__ import annotations

import sys

import pytest

from onnx_chunk.cli import main
from onnx_chunk.static.fix_shapes import fix_shapes


def _terminal(monkeypatch) -> None:
    """stderr claims to be a terminal (capsys still captures it); called in the test body,
    where capsys's stderr is in place."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)


def test_fix_shapes_reports_every_byte_it_hashes_and_copies(reference_model, tmp_path):
    model = reference_model()
    data = sum(path.stat().st_size for path in model.parent.glob("*.data"))
    calls = []
    fix_shapes(model, tmp_path / "fixed", rows=4, capacity=24,
               progress=lambda done, total: calls.append((done, total)))
    assert data > 0 and calls[-1] == (2 * data, 2 * data)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


def test_fix_shapes_shows_a_bar_on_a_terminal(reference_model, tmp_path, capsys, monkeypatch):
    _terminal(monkeypatch)
    assert main(["fix-shapes", str(reference_model()), "-o", str(tmp_path / "a"),
                 "--rows", "4", "--capacity", "24"]) == 0
    captured = capsys.readouterr()
    assert "hashing and copying weights" in captured.err and "100%" in captured.err
    assert "hashing" not in captured.out


@pytest.mark.parametrize("command", ["fix-shapes", "convert"])
def test_quiet_or_piped_shows_nothing(reference_model, tmp_path, capsys, monkeypatch, command):
    model = str(reference_model())
    arguments = (["fix-shapes", model, "-o", str(tmp_path / "out"), "--rows", "4",
                  "--capacity", "24"] if command == "fix-shapes"
                 else ["convert", model, "-o", str(tmp_path / "out" / "model.onnx")])
    assert main(arguments) == 0  # stderr is no terminal under capsys
    assert capsys.readouterr().err == ""
    _terminal(monkeypatch)
    assert main([*arguments[:-1], arguments[-1] + "2", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_validate_quiet_hides_the_bar(reference_model, capsys, monkeypatch):
    _terminal(monkeypatch)
    model = str(reference_model())
    assert main(["validate", model, "--provider", "cpu", "--lengths", "5", "--json"]) == 0
    assert "validating" in capsys.readouterr().err
    assert main(["validate", model, "--provider", "cpu", "--lengths", "5", "--json",
                 "--quiet"]) == 0
    assert "validating" not in capsys.readouterr().err


def test_generate_shows_the_prefill_of_a_long_prompt_on_a_terminal(capsys, monkeypatch):
    from tests.exports.corpus import ROOT

    model = str(ROOT / "genai-qwen3-fp32")
    prompt = "the quick brown fox jumps over the lazy dog " * 40
    arguments = ["generate", model, "--prompt", prompt, "--max-new-tokens", "2",
                 "--chunk-size", "64", "--provider", "cpu"]
    _terminal(monkeypatch)
    assert main(arguments) == 0
    err = capsys.readouterr().err
    assert "prefilling prompt" in err and "100%" in err
    assert main([*arguments, "--quiet"]) == 0
    assert "prefilling" not in capsys.readouterr().err
    short = ["generate", model, "--prompt", "hi", "--max-new-tokens", "2", "--provider", "cpu"]
    assert main(short) == 0
    assert "prefilling" not in capsys.readouterr().err
