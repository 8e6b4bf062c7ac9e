"""vLLM's end options in the text layer and the CLI: ignore_eos, stop_token_ids, min_tokens
(on a real export whose EOS id is set to the token greedy decoding gives first, so that
honouring or dropping an option changes the answer)."""

from __future__ import annotations

import json
import shutil

import pytest

from onnx_chunk.cli import main
from onnx_chunk.runtime import load
from onnx_chunk.sampling import Sampling
from onnx_chunk.text.generation import generate_text, stream_text
from onnx_chunk.text.tokenizer import tokenizer_of
from tests.exports.corpus import ROOT

PROMPT = "Paris is"
NEW = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The export with eos_token_id set to the first greedy token of PROMPT."""
    source = ROOT / "genai-qwen3-fp32"
    with load(source, provider="cpu") as runtime:
        tokens = generate_text(runtime, PROMPT, NEW, sampling=Sampling()).tokens
    folder = tmp_path_factory.mktemp("eos") / source.name
    shutil.copytree(source, folder)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = tokens[0]
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder, list(tokens)


@pytest.fixture(scope="module")
def runtime(folder):
    with load(folder[0], provider="cpu") as runtime:
        yield runtime


def _text(runtime, **ends):
    return generate_text(runtime, PROMPT, NEW, sampling=Sampling(), **ends)


def test_eos_ends_unless_ignored(runtime, folder):
    _, free = folder
    assert list(_text(runtime).tokens) == free[:1]
    ignored = _text(runtime, ignore_eos=True)
    assert list(ignored.tokens) == free and ignored.finish_reason == "length"


def test_min_tokens_holds_eos_back(runtime):
    held = _text(runtime, min_tokens=3)
    assert len(held.tokens) >= 4 or held.finish_reason == "length"
    assert tokenizer_of(runtime).eos_token_ids[0] not in held.tokens[:3]


def test_stop_token_ids_end_the_text_without_their_text(runtime, folder):
    _, free = folder
    stop_id = free[-1]
    stop = _text(runtime, ignore_eos=True, stop_token_ids=[stop_id])
    assert list(stop.tokens) == free[:free.index(stop_id) + 1] and stop.finish_reason == "stop"
    assert stop.text == tokenizer_of(runtime).decode(stop.tokens[:-1], skip_special_tokens=True)


def test_cli_ignore_eos_and_min_tokens(folder, capsys):
    path, free = folder
    args = ["generate", str(path), "--provider", "cpu", "--prompt", PROMPT, "--max-new-tokens",
            str(NEW), "--temperature", "0", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == free[:1]
    assert main([*args, "--ignore-eos"]) == 0
    entry = json.loads(capsys.readouterr().out)
    assert entry["tokens"] == free and entry["finish_reason"] == "length"
    assert main([*args, "--min-tokens", "2"]) == 0
    assert free[0] not in json.loads(capsys.readouterr().out)["tokens"][:2]


def test_cli_refuses_ignore_eos_with_token_ids(folder, capsys):
    path, _ = folder
    code = main(["generate", str(path), "--provider", "cpu", "--ids", "5,6",
                 "--max-new-tokens", "2", "--ignore-eos"])
    assert code == 2 and "--ignore-eos" in capsys.readouterr().err


def test_min_tokens_defers_stop_strings(runtime, folder):
    _, free = folder
    text = tokenizer_of(runtime).decode(free[:6], skip_special_tokens=True)
    stop = text[1:3]
    early = _text(runtime, ignore_eos=True, stop=stop)
    assert len(early.tokens) < 6 and early.finish_reason == "stop"
    deferred = _text(runtime, ignore_eos=True, stop=stop, min_tokens=6)
    assert len(deferred.tokens) > len(early.tokens)


def test_the_runtime_text_api_takes_the_end_options(runtime, folder):
    _, free = folder
    assert list(generate_text(runtime, PROMPT, NEW, sampling=Sampling()).tokens) == free[:1]
    ignored = generate_text(runtime, PROMPT, NEW, sampling=Sampling(), ignore_eos=True)
    assert list(ignored.tokens) == free and ignored.finish_reason == "length"
    streamed = "".join(stream_text(runtime, PROMPT, NEW, sampling=Sampling(), ignore_eos=True))
    assert streamed == ignored.text
    stopped = generate_text(runtime, PROMPT, NEW, sampling=Sampling(), ignore_eos=True,
                            stop_token_ids=[free[2]])
    first = free.index(free[2])
    assert list(stopped.tokens) == free[:first + 1] and stopped.finish_reason == "stop"
