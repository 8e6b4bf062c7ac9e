"""docs/text.md's promises that no other test holds it to."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil

import numpy as np
import pytest

from onnx_chunk import Sampling
from onnx_chunk.cli import main
from onnx_chunk.errors import CapacityError, ModelLoadError
from onnx_chunk.runtime import load
from onnx_chunk.sampling import Sampler
from onnx_chunk.text.chat_template import ChatTemplateFault
from onnx_chunk.text.tokenizer import Tokenizer
from tests.text.conftest import tokenizer_config, write_tokenizer

RUNTIME = ["--provider", "cpu", "--capacity", "512", "--chunk-size", "32"]
PROMPT = "Hello, world! Größe"


def _copy(text_model, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(text_model.parent, folder)
    return folder


def test_the_tokenizer_is_read_on_first_use(text_model, tmp_path):
    folder = _copy(text_model, tmp_path)
    (folder / "tokenizer.json").write_text("{not json")
    runtime = load(folder / "model.onnx", provider="cpu", capacity=64, chunk_size=16)
    assert len(runtime.open_sequence().generate([1, 2, 3], 2)) == 2
    with pytest.raises(ModelLoadError, match="as a tokenizer"):
        runtime.tokenizer  # noqa: B018 (the property reads the file)


def test_the_stream_holds_the_frozen_completion_once_it_ended(text_runtime):
    stream = text_runtime.stream_text(PROMPT, 6)
    assert stream.completion is None
    text = "".join(stream)
    completion = stream.completion
    assert completion == text_runtime.generate_text(PROMPT, 6) and completion.text == text
    with pytest.raises(dataclasses.FrozenInstanceError):
        completion.text = "changed"
    stats = completion.stats
    assert 0 < stats.ttft_s <= stats.total_s and stats.queued_s >= 0
    assert stats.decode_tokens_per_s > 0


def test_a_prompt_without_room_is_refused_at_the_stream_call(text_model):
    runtime = load(text_model, provider="cpu", capacity=40, chunk_size=32)
    with pytest.raises(CapacityError):
        runtime.stream_text("word " * 60, 5)  # not iterated: refused before any work


def test_json_prints_the_decode_rate_and_the_penalties_override(text_model, text_runtime,
                                                                capsys):
    assert main(["generate", str(text_model), "--prompt", PROMPT, "--max-new-tokens", "8",
                 "--presence-penalty", "1.5", "--frequency-penalty", "0.5", "--json",
                 *RUNTIME]) == 0
    entry = json.loads(capsys.readouterr().out)
    expected = text_runtime.generate_text(PROMPT, 8, sampling=Sampling(
        presence_penalty=1.5, frequency_penalty=0.5))
    assert entry["tokens"] == list(expected.tokens) and entry["decode_tokens_per_s"] > 0
    assert entry["sampling"]["presence_penalty"] == 1.5
    assert entry["sampling"]["frequency_penalty"] == 0.5


def test_top_k_alone_on_a_greedy_model_stays_greedy(text_model, text_runtime, capsys):
    genai = json.loads((text_model.parent / "genai_config.json").read_text())
    assert not genai["search"].get("do_sample", False)
    assert main(["generate", str(text_model), "--prompt", PROMPT, "--max-new-tokens", "8",
                 "--top-k", "40", "--json", *RUNTIME]) == 0
    greedy = text_runtime.generate_text(PROMPT, 8, sampling=Sampling())
    assert json.loads(capsys.readouterr().out)["tokens"] == list(greedy.tokens)


def test_chat_exit_quits_and_a_refused_turn_goes_on(text_model, tmp_path, monkeypatch, capsys):
    folder = _copy(text_model, tmp_path)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.content == 'bad' %}{{ raise_exception('no bad') }}"
        "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    monkeypatch.setattr("sys.stdin", io.StringIO("bad\nhi\n/exit\nnever read\n"))
    assert main(["chat", str(folder), "--max-new-tokens", "3", *RUNTIME]) == 0
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no bad" in errors[0]
    assert sum(line.startswith("[turn") for line in captured.err.splitlines()) == 1
    assert "never read" not in captured.out


def test_chat_without_cache_reuse_feeds_the_whole_conversation(text_model, monkeypatch,
                                                               capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\nWhat next?\n"))
    assert main(["chat", str(text_model), "--no-cache-reuse", "--max-new-tokens", "4",
                 *RUNTIME]) == 0
    turns = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[turn")]
    assert len(turns) == 2 and all(" 0 held in the cache" in line for line in turns)


def test_the_special_tokens_map_does_not_override_a_config_with_added_tokens(
        tmp_path, byte_level_tokenizer):
    decoder = {"2": {"content": "<|im_end|>", "special": True}}
    folder = write_tokenizer(tmp_path, byte_level_tokenizer,
                             tokenizer_config(added_tokens_decoder=decoder))
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|pad|>"}))
    assert Tokenizer.load(folder).eos_token_ids == (2,)


def test_stored_padding_and_truncation_are_off(tmp_path, byte_level_tokenizer):
    for name in ("plain", "stored"):
        (tmp_path / name).mkdir()
    plain = Tokenizer.load(write_tokenizer(tmp_path / "plain", byte_level_tokenizer))
    text = "The quick brown fox jumps over the lazy dog."
    ids = plain.encode(text)
    stored = byte_level_tokenizer.from_str(byte_level_tokenizer.to_str())
    stored.enable_truncation(max_length=3)
    stored.enable_padding(length=len(ids) + 10, pad_id=0, pad_token="<|pad|>")
    assert stored.encode(text).ids != ids  # the stored settings do change the ids
    assert Tokenizer.load(write_tokenizer(tmp_path / "stored", stored)).encode(text) == ids


def test_the_template_runs_sandboxed_with_tools_and_documents_none(tmp_path,
                                                                   byte_level_tokenizer):
    folder = write_tokenizer(tmp_path, byte_level_tokenizer, tokenizer_config(
        "{{ tools is none }} {{ documents is none }} {{ messages | length }}"))
    tokenizer = Tokenizer.load(folder)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "True True 1"
    (folder / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateFault, match="SecurityError"):
        Tokenizer.load(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_ties_at_a_cut_stay_together():
    logits = np.array([3.0, 2.0, 2.0, -1.0], dtype=np.float32)
    for sampling in (Sampling(temperature=1.0, top_k=2, seed=3),
                     Sampling(temperature=1.0, min_p=0.3, seed=3)):
        sampler = Sampler(sampling, logits.size)
        drawn = {sampler.choose(logits) for _ in range(3000)}
        assert drawn == {0, 1, 2}, sampling


def test_a_sequence_samples_when_asked_and_is_greedy_by_default(text_runtime):
    ids = text_runtime.tokenizer.encode(PROMPT)
    greedy = text_runtime.open_sequence().generate(ids, 12)
    assert text_runtime.open_sequence().generate(ids, 12, sampling=Sampling()) == greedy
    sampling = Sampling(temperature=1.5, seed=2)
    sampled = text_runtime.open_sequence().generate(ids, 12, sampling=sampling)
    assert sampled != greedy
    assert text_runtime.open_sequence().generate(ids, 12, sampling=sampling) == sampled
    streamed = list(text_runtime.open_sequence().stream(ids, 12, sampling=sampling))
    assert streamed == sampled
