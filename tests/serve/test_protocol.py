"""The request bodies' rules, apart from any server (onnx_chunk.serve.protocol)."""

from __future__ import annotations

import pytest

from onnx_chunk.errors import InputError
from onnx_chunk.serve.protocol import (
    GenerationParams,
    RequestError,
    error_body,
    parse_chat,
    parse_completion,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_chat_body_with_every_option():
    params = parse_chat({"model": "m", "messages": [
        {"role": "system", "content": "be terse"},
        {"role": "user",
         "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 9, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "x",
        "stream": True, "stream_options": {"include_usage": True}, "n": 1, "user": "ignored"})
    assert params == GenerationParams(
        messages=({"role": "system", "content": "be terse"}, {"role": "user", "content": "ab"}),
        max_tokens=9, temperature=0.0, top_p=0.5, seed=3, stop=("x",), stream=True,
        include_usage=True, model="m")


@pytest.mark.parametrize(("prompt", "expected"), [
    ("text", "text"), (["text"], "text"), ([1, 2, 3], (1, 2, 3)), ([[4, 5]], (4, 5))])
def test_a_completion_prompt_is_text_or_token_ids(prompt, expected):
    params = parse_completion({"prompt": prompt})
    assert params.prompt == expected and params.max_tokens is None and not params.stream


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [True]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"), ({"prompt": None}, "prompt"),
    ({"prompt": "a", "temperature": True}, "temperature"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"), ({"prompt": "a", "seed": 1.0}, "seed"),
    ({"prompt": "a", "n": True}, "n"), ({"prompt": "a", "model": 3}, "model"),
    ({"prompt": "a", "stop": 5}, "stop"), ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "n": 17}, "n"), ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": "a", "stream_options": []}, "stream_options"),
    ({"prompt": "a", "stream_options": {"include_usage": 1}}, "stream_options"),
])
def test_a_bad_completion_field_names_its_param(body, param):
    with pytest.raises(RequestError) as caught:
        parse_completion(body)
    assert caught.value.param == param and caught.value.status == 400
    assert isinstance(caught.value, InputError)


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"messages": [3]}, "messages[0]"), ({"messages": MESSAGES, "max_tokens": None,
                                           "max_completion_tokens": -1},
                                          "max_completion_tokens"),
])
def test_a_bad_chat_field_names_its_param(body, param):
    with pytest.raises(RequestError) as caught:
        parse_chat(body)
    assert caught.value.param == param


def test_absent_and_null_options_take_the_defaults():
    params = parse_chat({"messages": MESSAGES, "temperature": None, "stream": None,
                         "stop": None, "seed": None, "n": None})
    assert params == GenerationParams(messages=tuple(MESSAGES))


def test_the_error_body_has_openais_four_fields():
    assert error_body("no", "invalid_request_error", param="n", code="c") == {
        "error": {"message": "no", "type": "invalid_request_error", "param": "n", "code": "c"}}


def test_a_null_max_completion_tokens_falls_back_to_max_tokens():
    assert parse_chat({"messages": MESSAGES, "max_tokens": 5,
                       "max_completion_tokens": None}).max_tokens == 5
    assert parse_chat({"messages": MESSAGES, "max_tokens": 5,
                       "max_completion_tokens": 7}).max_tokens == 7
    with pytest.raises(RequestError) as caught:
        parse_chat({"messages": MESSAGES, "max_tokens": 0, "max_completion_tokens": None})
    assert caught.value.param == "max_tokens"


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a\ud800"}, "prompt"),
    ({"prompt": "a", "stop": "\udfff"}, "stop"),
    ({"messages": [{"role": "us\ud800er", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "\udc00"}]}, "messages[0].content"),
])
def test_a_lone_surrogate_is_refused_naming_its_field(body, param):
    with pytest.raises(RequestError, match="lone surrogate") as caught:
        (parse_chat if "messages" in body else parse_completion)(body)
    assert caught.value.param == param and caught.value.status == 400


def test_a_completion_takes_a_list_of_prompts_and_n():
    params = parse_completion({"prompt": ["one", [4, 5], "two"], "n": 3, "echo": True,
                               "max_tokens": 0})
    assert params.prompts == ("one", (4, 5), "two") and params.prompt == "one"
    assert params.n == 3 and params.max_tokens == 0
