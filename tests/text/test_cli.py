"""`onnx-chunk generate --prompt` and `onnx-chunk chat` through the CLI entry point."""

from __future__ import annotations

import io
import json

import pytest

from onnx_chunk import Sampling
from onnx_chunk.cli import main
from onnx_chunk.runtime import load
from onnx_chunk.text.generation import generate_text

RUNTIME = ["--provider", "cpu", "--capacity", "512", "--chunk-size", "32"]


@pytest.fixture(scope="module")
def runtime(text_model):
    return load(text_model, provider="cpu", capacity=512, chunk_size=32)


def test_prompt_text_streams_to_stdout_and_the_summary_to_stderr(text_model, runtime, capsys):
    assert main(["generate", str(text_model.parent), "--prompt", "Hello, world",
                 "--max-new-tokens", "12", *RUNTIME]) == 0
    captured = capsys.readouterr()
    assert captured.out == generate_text(runtime, "Hello, world", 12).text + "\n"
    assert "[length: 12 tokens after a" in captured.err


def test_json_chat_with_sampling_and_stop(text_model, runtime, capsys):
    args = ["generate", str(text_model), "--prompt", "Hi there", "--chat", "--system", "Terse.",
            "--max-new-tokens", "10", "--temperature", "0.9", "--top-k", "20", "--top-p", "0.9",
            "--min-p", "0.01", "--repetition-penalty", "1.2", "--seed", "4", "--stop", "zzz",
            "--stop", "qqq", "--json", *RUNTIME]
    assert main(args) == 0
    entry = json.loads(capsys.readouterr().out)
    sampling = Sampling(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01,
                        repetition_penalty=1.2, seed=4)
    messages = [{"role": "system", "content": "Terse."}, {"role": "user", "content": "Hi there"}]
    expected = generate_text(runtime, messages, 10, sampling=sampling, stop=["zzz", "qqq"])
    assert entry["text"] == expected.text and entry["tokens"] == list(expected.tokens)
    assert entry["finish_reason"] == expected.finish_reason
    assert entry["prompt_tokens"] == expected.prompt_tokens
    assert entry["sampling"]["seed"] == 4 and entry["ttft_s"] > 0
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == entry["tokens"]


@pytest.mark.parametrize("extra, message", [
    (["--prompt", "hi", "--ids", "1,2"], "--ids cannot be used with --prompt"),
    (["--prompt", "hi", "--eos-token-id", "2"], "--eos-token-id cannot be used with --prompt"),
    (["--prompt", "hi", "--system", "x"], "--system needs --chat"),
    (["--prompt", "hi", "--top-p", "0"], "top_p must be a number in (0, 1]"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature must be a number in [0, 2]"),
    (["--prompt", "hi", "--stop", ""], "non-empty string"),
    (["--ids", "1,2", "--temperature", "0.5"], "--temperature cannot be used with token ids"),
])
def test_bad_text_options_exit_2_with_one_line(text_model, capsys, extra, message):
    assert main(["generate", str(text_model), "--max-new-tokens", "3", *RUNTIME, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_prompt_on_a_model_without_a_tokenizer_says_so(reference_model, capsys):
    assert main(["generate", str(reference_model("base")), "--prompt", "hi",
                 "--max-new-tokens", "3", "--provider", "cpu", "--capacity", "64"]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err


def test_chat_keeps_the_conversation_in_the_cache(text_model, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n\nWhat next?\n/reset\nBye\n"))
    assert main(["chat", str(text_model), "--system", "Terse.", "--max-new-tokens", "8",
                 *RUNTIME]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("> Hello there\n") and "> What next?\n" in captured.out
    turns = [line for line in captured.err.splitlines() if line.startswith("[turn")]
    assert len(turns) == 3
    assert "0 held in the cache (empty cache)" in turns[0]
    assert "0 held" not in turns[1]
    assert "(new conversation)" in captured.err and "empty cache" in turns[2]


def test_chat_reports_a_turn_that_does_not_fit_and_goes_on(text_model, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("word " * 80 + "\nhi\n"))
    assert main(["chat", str(text_model), "--max-new-tokens", "4", "--provider", "cpu",
                 "--capacity", "64"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and "positions" in captured.err
    assert "[turn 1:" in captured.err
