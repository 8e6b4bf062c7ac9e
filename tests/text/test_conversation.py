"""Chat turns run on the batch engine, whose prefix reuse keeps the conversation in a slot's
KV cache, so each turn prefills only what the slot lacks."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from onnx_chunk.runtime import load
from onnx_chunk.text.conversation import Continuation, Conversation, continuation
from onnx_chunk.text.tokenizer import tokenizer_of


def _encode(text):
    return [ord(character) for character in text]


@pytest.mark.parametrize("cached_ids, cached_text, new_text, expected", [
    ([], "", "abc", Continuation([97, 98, 99], 0, "empty cache")),
    ([97, 98], "ab", "abcd", Continuation([99, 100], 2, "token prefix")),
    ([5, 6], "ab", "abcd", Continuation([99, 100], 2, "text prefix")),
])
def test_continuation_feeds_what_the_cache_lacks(cached_ids, cached_text, new_text, expected):
    assert continuation(cached_ids, cached_text, _encode(new_text), new_text,
                        _encode) == expected


def test_continuation_starts_over_when_the_rendering_rewrites_the_past():
    plan = continuation([97, 98], "ab", _encode("xbcd"), "xbcd", _encode)
    assert plan.reused == 0 and plan.ids == _encode("xbcd") and "no prefix" in plan.how
    assert continuation([97, 98], "ab", _encode("ab"), "ab", _encode).reused == 0


def test_turn_two_feeds_only_the_new_turn_and_continues_the_cache(text_runtime):
    conversation = Conversation(text_runtime, system="You are terse.")
    first = "".join(conversation.say("Hello there, 日本", 12))
    assert first == conversation.last_completion.text
    assert conversation.last_turn.reused_tokens == 0
    before = conversation.cached_ids
    "".join(conversation.say("And then?", 12))
    turn = conversation.last_turn
    rendered = tokenizer_of(text_runtime).apply_chat_template(conversation.messages[:-1])
    whole = tokenizer_of(text_runtime).encode(rendered, add_special_tokens=False)
    assert turn.reused_tokens == len(before) and 0 < len(turn.fed_ids) < len(whole) // 2
    # The reply is what a fresh sequence fed the same ids at once gives.
    fresh = text_runtime.open_sequence().generate([*before, *turn.fed_ids], 12)
    assert list(conversation.last_completion.tokens) == fresh
    assert [message["role"] for message in conversation.messages] == [
        "system", "user", "assistant", "user", "assistant"]


def test_without_reuse_every_turn_feeds_the_whole_conversation(text_model):
    runtime = load(text_model, provider="cpu", capacity=512, chunk_size=32, prefix_reuse=False)
    conversation = Conversation(runtime, reuse_cache=False)
    "".join(conversation.say("Hello", 6))
    "".join(conversation.say("Again", 6))
    rendered = tokenizer_of(runtime).apply_chat_template(conversation.messages[:-1])
    assert conversation.last_turn.fed_ids == tuple(
        tokenizer_of(runtime).encode(rendered, add_special_tokens=False))
    assert conversation.last_turn.reused_tokens == 0


def test_every_turn_gives_the_tokens_of_its_whole_prompt_fed_at_once(text_model, text_runtime):
    """Each turn's prompt (the kept ids and the new ones) on a runtime that reuses nothing:
    the same reply tokens, though the turn prefilled only what its slot lacked."""
    plain = load(text_model, provider="cpu", capacity=512, chunk_size=32, prefix_reuse=False)
    conversation = Conversation(text_runtime)
    for content in ("Hello there", "And then, and then?", "Bye."):
        "".join(conversation.say(content, 10))
        completion = conversation.last_completion
        prompt = list(conversation.cached_ids[:completion.prompt_tokens])
        assert list(completion.tokens) == plain.submit(prompt, 10).result()
    assert conversation.last_turn.reused_tokens > completion.prompt_tokens // 2


def test_a_template_that_rewrites_earlier_turns_falls_back_with_a_logged_reason(
        text_model, tmp_path, caplog):
    folder = tmp_path / "model"
    shutil.copytree(text_model.parent, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # Only the last message is rendered, so earlier turns vanish from the prompt.
    config["chat_template"] = ("{{ messages[-1]['role'] + ': ' + messages[-1]['content'] }}"
                               "{% if add_generation_prompt %}\nassistant: {% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    runtime = load(folder / "model.onnx", provider="cpu", capacity=256, chunk_size=32)
    conversation = Conversation(runtime)
    "".join(conversation.say("one", 4))
    first = conversation.cached_ids
    with caplog.at_level(logging.INFO, logger="onnx_chunk.text.conversation"):
        "".join(conversation.say("two", 4))
    assert "submitting the whole conversation again" in caplog.text
    assert "no prefix" in conversation.last_turn.how
    # The engine reuses only the head both renderings share ("user: "), not the first turn.
    assert conversation.last_turn.reused_tokens < len(first)


def test_a_reply_left_unread_is_not_counted_as_cached(text_runtime):
    conversation = Conversation(text_runtime)
    reply = conversation.say("Hello", 12)
    next(reply)
    reply.close()
    "".join(conversation.say("Hello", 12))
    assert conversation.last_turn.how == "the last reply was not read to its end"
    # The whole rendering was submitted; the engine reused what the slot held of it.
    assert 0 < conversation.last_turn.reused_tokens < len(conversation.cached_ids)


@pytest.mark.parametrize("reuse_cache", [True, False])
def test_a_refused_turn_leaves_the_cache_as_it_was(text_runtime, reuse_cache):
    from onnx_chunk.errors import InputError

    chat = Conversation(text_runtime, reuse_cache=reuse_cache)
    "".join(chat.say("Hello there", 4))
    cached = chat.cached_ids
    with pytest.raises(InputError):
        chat.say("again", 4, stop="")
    assert chat.cached_ids == cached and cached
    "".join(chat.say("again", 4))
    # The slot still holds the first turn (reuse_cache=False encodes the reply again, which
    # may split it otherwise: then less of it is reused).
    assert (chat.last_turn.reused_tokens == len(cached) if reuse_cache
            else 0 < chat.last_turn.reused_tokens <= len(cached))
