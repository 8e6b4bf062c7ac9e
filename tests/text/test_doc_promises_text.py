"""docs/text.md's promises that no other test holds it to."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import time

import numpy as np
import pytest

from onnx_chunk import Sampling
from onnx_chunk.cli import main
from onnx_chunk.errors import CapacityError, ModelLoadError
from onnx_chunk.runtime import load
from onnx_chunk.sampling import Sampler
from onnx_chunk.text.chat_template import ChatTemplateSandboxError
from onnx_chunk.text.conversation import Conversation
from onnx_chunk.text.generation import generate_text, stream_text
from onnx_chunk.text.prompt import PromptEncoder
from onnx_chunk.text.tokenizer import Tokenizer, tokenizer_of
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
        tokenizer_of(runtime)  # reads the file


def test_the_stream_holds_the_frozen_completion_once_it_ended(text_runtime):
    stream = stream_text(text_runtime, PROMPT, 6)
    assert stream.completion is None
    text = "".join(stream)
    completion = stream.completion
    assert completion == generate_text(text_runtime, PROMPT, 6) and completion.text == text
    with pytest.raises(dataclasses.FrozenInstanceError):
        completion.text = "changed"
    stats = completion.stats
    assert 0 < stats.ttft_s <= stats.total_s and stats.queued_s >= 0
    assert stats.decode_tokens_per_s > 0


def test_a_prompt_without_room_is_refused_at_the_stream_call(text_model):
    runtime = load(text_model, provider="cpu", capacity=40, chunk_size=32)
    with pytest.raises(CapacityError):
        stream_text(runtime, "word " * 60, 5)  # not iterated: refused before any work


def test_json_prints_the_decode_rate_and_the_penalties_override(text_model, text_runtime,
                                                                capsys):
    assert main(["generate", str(text_model), "--prompt", PROMPT, "--max-new-tokens", "8",
                 "--presence-penalty", "1.5", "--frequency-penalty", "0.5", "--json",
                 *RUNTIME]) == 0
    entry = json.loads(capsys.readouterr().out)
    expected = generate_text(text_runtime, PROMPT, 8, sampling=Sampling(
        presence_penalty=1.5, frequency_penalty=0.5))
    assert entry["tokens"] == list(expected.tokens) and entry["decode_tokens_per_s"] > 0
    assert entry["sampling"]["presence_penalty"] == 1.5
    assert entry["sampling"]["frequency_penalty"] == 0.5


def test_top_k_alone_on_a_greedy_model_stays_greedy(text_model, text_runtime, capsys):
    genai = json.loads((text_model.parent / "genai_config.json").read_text())
    assert not genai["search"].get("do_sample", False)
    assert main(["generate", str(text_model), "--prompt", PROMPT, "--max-new-tokens", "8",
                 "--top-k", "40", "--json", *RUNTIME]) == 0
    greedy = generate_text(text_runtime, PROMPT, 8, sampling=Sampling())
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
    with pytest.raises(ChatTemplateSandboxError, match="SecurityError"):
        Tokenizer.load(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_ties_at_a_cut_stay_together():
    logits = np.array([3.0, 2.0, 2.0, -1.0], dtype=np.float32)
    for sampling in (Sampling(temperature=1.0, top_k=2, seed=3),
                     Sampling(temperature=1.0, min_p=0.3, seed=3)):
        sampler = Sampler(sampling, logits.size)
        drawn = {sampler.choose(logits) for _ in range(3000)}
        assert drawn == {0, 1, 2}, sampling


def test_a_sequence_samples_when_asked_and_is_greedy_by_default(text_runtime):
    ids = tokenizer_of(text_runtime).encode(PROMPT)
    greedy = text_runtime.open_sequence().generate(ids, 12)
    assert text_runtime.open_sequence().generate(ids, 12, sampling=Sampling()) == greedy
    sampling = Sampling(temperature=1.5, seed=2)
    sampled = text_runtime.open_sequence().generate(ids, 12, sampling=sampling)
    assert sampled != greedy
    assert text_runtime.open_sequence().generate(ids, 12, sampling=sampling) == sampled
    streamed = list(text_runtime.open_sequence().stream(ids, 12, sampling=sampling))
    assert streamed == sampled


def _stop_in(text: str) -> str:
    """A 3-character piece of `text` past its start, found there first, with no U+FFFD."""
    return next(text[i:i + 3] for i in range(4, len(text) - 3)
                if "\ufffd" not in text[i:i + 3] and text.find(text[i:i + 3]) == i)


def test_a_stop_string_cancels_the_request_and_ends_with_the_token_that_completed_it(
        text_model, monkeypatch):
    runtime = load(text_model, provider="cpu", capacity=512, chunk_size=32, max_batch=1)
    greedy = generate_text(runtime, PROMPT, 24)
    stop = _stop_in(greedy.text)
    # Each forward takes a while, so the request is still running when the stop shows.
    runner = type(runtime.debug.runner)
    original = runner.run

    def slow(self, *args, **kwargs):
        time.sleep(0.005)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(runner, "run", slow)
    before = runtime.stats.engine
    completion = generate_text(runtime, PROMPT, 400, stop=stop)
    after = runtime.stats.engine
    assert completion.finish_reason == "stop" and after.cancelled == before.cancelled + 1
    assert after.decode_steps - before.decode_steps < 100
    decode = tokenizer_of(runtime).decode
    assert stop in decode(completion.tokens, skip_special_tokens=True)
    assert stop not in decode(completion.tokens[:-1], skip_special_tokens=True)
    # Its one slot is free again: the next request runs.
    assert len(runtime.submit(list(greedy.tokens[:4]), 2).result(timeout=30)) == 2
    runtime.close()


def _token_starts(tokenizer, text: str, tokens) -> list[int]:
    """Where each token's text starts in `text` (None where a token splits a character)."""
    text_so_far = ""
    starts = []
    for count in range(len(tokens)):
        head = tokenizer.decode(tokens[:count], skip_special_tokens=True)
        starts.append(len(head) if text.startswith(head) and head.startswith(text_so_far)
                      else None)
        text_so_far = head
    return starts


@pytest.mark.parametrize("begins", ["in the last token", "before the last token"])
def test_a_stop_string_begun_before_the_last_token_submits_the_whole_rendering(text_runtime,
                                                                              begins):
    tokenizer = tokenizer_of(text_runtime)
    plain = Conversation(text_runtime)
    reply = "".join(plain.say("Hello there", 16))
    starts = _token_starts(tokenizer, reply, plain.last_completion.tokens)
    spans = [(a, b) for a, b in zip(starts, starts[1:])
             if a is not None and b is not None and b - a >= 2 and 0 < a and b < len(reply)]
    # A stop of 2 characters: a token's first two, or its last and the next token's first.
    at = [a if begins == "in the last token" else b - 1 for a, b in spans]
    stop = next(reply[i:i + 2] for i in at
                if reply.find(reply[i:i + 2]) == i and "\ufffd" not in reply[i:i + 2])
    chat = Conversation(text_runtime)
    assert "".join(chat.say("Hello there", 16, stop=stop)) == reply[:reply.find(stop)]
    "".join(chat.say("And then?", 4))
    turn = chat.last_turn
    whole = PromptEncoder(tokenizer).encode(chat.messages[:-1])
    if begins == "in the last token":  # the kept tokens stand for the text before the stop
        assert turn.how == "text prefix" and len(turn.fed_ids) < len(whole) // 2
    else:
        assert turn.how.startswith("the cached conversation is no prefix")
        # The engine still reuses the head the slot shares with the new rendering.
        assert 0 < turn.reused_tokens and turn.reused_tokens + len(turn.fed_ids) == len(whole)


def test_logprobs_without_json_print_one_line_a_token_on_stderr(text_model, capsys):
    assert main(["generate", str(text_model), "--prompt", PROMPT, "--max-new-tokens", "5",
                 "--ignore-eos", "--logprobs", "2", *RUNTIME]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 6 and lines[-1].startswith("[length: 5 tokens")
    assert all(line.count("\t") == 2 for line in lines[:5])


@pytest.mark.parametrize("extra", [["--prompt", "hi", "--ids-file", "IDS"],
                                   ["--random-prompt", "3", "--top-k", "5"],
                                   ["--ids-file", "IDS", "--stop", "x"]])
def test_text_options_with_other_prompts_are_one_error_line(text_model, tmp_path, capsys,
                                                            extra):
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3\n")
    args = [str(ids) if arg == "IDS" else arg for arg in extra]
    assert main(["generate", str(text_model), "--max-new-tokens", "2", *RUNTIME, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
