"""`onnx-chunk serve`'s refusals: one `error:` line, exit 2, before or instead of serving."""

from __future__ import annotations

import socket
import sys

from onnx_chunk.cli import main
from tests.cli_output import one_error_line
from tests.serve.conftest import EXPORT


def test_a_busy_port_is_one_error_line(capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert main(["serve", str(EXPORT), "--provider", "cpu", "--port", str(port)]) == 2
    one_error_line(capsys, f"cannot listen on 127.0.0.1:{port}", "--port")


def test_a_missing_model_is_one_error_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nothing"), "--port", "0"]) == 2
    one_error_line(capsys, "nothing")


def test_a_model_without_a_tokenizer_is_one_error_line(reference_model, capsys):
    assert main(["serve", str(reference_model()), "--provider", "cpu", "--port", "0"]) == 2
    one_error_line(capsys, "tokenizer")


def test_an_empty_api_key_is_refused(capsys):
    assert main(["serve", str(EXPORT), "--port", "0", "--api-key", " "]) == 2
    one_error_line(capsys, "--api-key")


def test_without_the_serve_extra_the_command_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    monkeypatch.delitem(sys.modules, "onnx_chunk.serve.server", raising=False)
    assert main(["serve", str(EXPORT), "--port", "0"]) == 2
    one_error_line(capsys, "uvicorn", "onnx-chunk[serve]")


def test_serve_is_listed_in_the_help(capsys):
    assert main(["--help"]) == 0
    assert "serve" in capsys.readouterr().out


def test_speculative_decoding_on_a_decoder_that_cannot_take_drafts_back_is_refused(capsys):
    lfm2 = EXPORT.parent / "genai-lfm2-fp32"
    assert main(["serve", str(lfm2), "--provider", "cpu", "--port", "0",
                 "--speculative", "prompt-lookup"]) == 2
    one_error_line(capsys, "speculative", "recurrent state")


def test_exact_mode_with_speculative_decoding_is_refused(capsys):
    assert main(["serve", str(EXPORT), "--provider", "cpu", "--port", "0", "--exact",
                 "--speculative", "prompt-lookup"]) == 2
    one_error_line(capsys, "exact mode", "speculative")


def test_exact_reaches_the_runtime(monkeypatch, capsys):
    import onnx_chunk.runtime
    from onnx_chunk.errors import ConfigError

    asked = {}

    def load(model, **options):
        asked.update(options)
        raise ConfigError("stopped before serving")

    monkeypatch.setattr(onnx_chunk.runtime, "load", load)
    assert main(["serve", str(EXPORT), "--provider", "cpu", "--port", "0", "--exact"]) == 2
    one_error_line(capsys, "stopped before serving")
    assert asked["exact"] is True
