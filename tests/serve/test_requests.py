"""The request models, apart from any server (onnx_chunk.serve.requests): one pass over the
body gives its options and prompt, or one refusal naming its `param`."""

from __future__ import annotations

import json
import random

import pytest

from onnx_chunk.errors import InputError
from onnx_chunk.serve.parameters import REFUSED, RequestOptions
from onnx_chunk.serve.protocol import RequestError, error_body
from onnx_chunk.serve.requests import KNOWN_FIELDS, ChatCompletionRequest, CompletionRequest
from onnx_chunk.serve.tokenize import DetokenizeRequest, TokenizeRequest

MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "a", "description": "d",
                                         "parameters": {"type": "object"}}, "extra": 1}


def _refused(model, body: object, vocab_size: int | None = None) -> RequestError:
    with pytest.raises(RequestError) as caught:
        model.parse(body, vocab_size=vocab_size)
    assert caught.value.status == 400 and isinstance(caught.value, InputError)
    return caught.value


def test_a_chat_body_with_every_basic_option():
    request = ChatCompletionRequest.parse({"model": "m", "messages": [
        {"role": "system", "content": "be terse"},
        {"role": "user",
         "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 9, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "x",
        "stream": True, "stream_options": {"include_usage": True}, "n": 1, "user": "ignored"})
    assert request.template_messages() == [{"role": "system", "content": "be terse"},
                                           {"role": "user", "content": "a\nb"}]
    assert request.options == RequestOptions(
        max_tokens=9, temperature=0.0, top_p=0.5, seed=3, stop=("x",), stream=True,
        include_usage=True, model="m")


@pytest.mark.parametrize(("prompt", "expected"), [
    ("text", ("text",)), (["text"], ("text",)), ([1, 2, 3], ((1, 2, 3),)), ([[4, 5]], ((4, 5),)),
    (["one", [4, 5], "two"], ("one", (4, 5), "two"))])
def test_a_completion_prompt_is_text_or_token_ids_or_a_list_of_them(prompt, expected):
    request = CompletionRequest.parse({"prompt": prompt})
    assert request.prompts() == expected
    assert request.options.max_tokens is None and not request.options.stream


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [True]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"), ({"prompt": None}, "prompt"), ({}, "prompt"),
    ({"prompt": "a", "temperature": True}, "temperature"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"), ({"prompt": "a", "seed": 1.0}, "seed"),
    ({"prompt": "a", "n": True}, "n"), ({"prompt": "a", "model": 3}, "model"),
    ({"prompt": "a", "stop": 5}, "stop"), ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "n": 17}, "n"), ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": "a", "stop": ["a"] * 5}, "stop"),
    ({"prompt": "a", "stream_options": []}, "stream_options"),
    ({"prompt": "a", "stream_options": {"include_usage": 1}}, "stream_options"),
    ({"prompt": "a", "temperature": "1"}, "temperature"),
    ({"prompt": "a", "top_k": -2}, "top_k"), ({"prompt": "a", "cache_salt": ""}, "cache_salt"),
])
def test_a_bad_completion_field_names_its_param(body, param):
    error = _refused(CompletionRequest, body)
    assert error.param == param and f"'{param}'" in str(error)


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"messages": [3]}, "messages[0]"), ({"messages": []}, "messages"), ({}, "messages"),
    ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {
        "name": "a"}}]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "a",
                                                                      "arguments": "{"}}]}]},
     "messages[0].tool_calls[0]"),
    ({"messages": [*MESSAGES, {"role": "tool", "content": "1"}]}, "messages[1].tool_call_id"),
    ({"messages": MESSAGES, "max_tokens": None, "max_completion_tokens": -1},
     "max_completion_tokens"),
    ({"messages": MESSAGES, "tools": [{"type": "retrieval"}]}, "tools"),
    ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MESSAGES, "tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": MESSAGES, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MESSAGES, "logprobs": 3}, "logprobs"),
    ({"messages": MESSAGES, "repeat_penalty": 1.1, "repetition_penalty": 1.2},
     "repeat_penalty"),
    ({"messages": MESSAGES, "max_tokens": 2, "n_predict": 2}, "n_predict"),
    ({"messages": MESSAGES, "response_format": {"type": "json_object"}, "stop": "}"}, "stop"),
    ({"messages": MESSAGES, "response_format": {"type": "json_object"}, "ignore_eos": True},
     "ignore_eos"),
    ({"messages": MESSAGES, "response_format": {"type": "json_object"},
      "json_schema": {"type": "object"}}, "json_schema"),
    ({"messages": MESSAGES, "metadata": {"a": 1}}, "metadata"),
])
def test_a_bad_chat_field_names_its_param(body, param):
    assert _refused(ChatCompletionRequest, body).param == param


def test_absent_and_null_options_take_the_defaults():
    request = ChatCompletionRequest.parse({"messages": MESSAGES, "temperature": None,
                                           "stream": None, "stop": None, "seed": None,
                                           "n": None})
    assert request.options == RequestOptions()


def test_the_error_body_has_openais_four_fields():
    assert error_body("no", "invalid_request_error", param="n", code="c") == {
        "error": {"message": "no", "type": "invalid_request_error", "param": "n", "code": "c"}}


def test_the_length_fields():
    def length(**fields):
        return ChatCompletionRequest.parse({"messages": MESSAGES, **fields}).options.max_tokens

    assert length(max_tokens=5, max_completion_tokens=None) == 5
    assert length(max_tokens=5, max_completion_tokens=7) == 7
    assert length(n_predict=3) == 3 and length(n_predict=-1) is None
    assert length(max_output_tokens=2) == 2
    assert _refused(ChatCompletionRequest, {"messages": MESSAGES, "max_tokens": 0,
                                            "max_completion_tokens": None}).param == "max_tokens"
    echo = CompletionRequest.parse({"prompt": "a", "echo": True, "max_tokens": 0})
    assert echo.options.max_tokens == 0 and echo.options.echo


@pytest.mark.parametrize(("model", "body", "param"), [
    (CompletionRequest, {"prompt": "a\ud800"}, "prompt"),
    (CompletionRequest, {"prompt": "a", "stop": "\udfff"}, "stop"),
    (CompletionRequest, {"prompt": ["a", "b\udfff"]}, "prompt"),
    (ChatCompletionRequest, {"messages": [{"role": "us\ud800er", "content": "hi"}]},
     "messages[0].role"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "\udc00"}]},
     "messages[0].content"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udc00"}]}]}, "messages[0].content[0]"),
    (ChatCompletionRequest, {"messages": MESSAGES, "tools": [
        {**TOOL, "function": {"name": "a", "parameters": {"x": "\ud800"}}}]}, "tools"),
    (ChatCompletionRequest, {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "\udc00", "function": {"name": "a"}}]}]}, "messages[0].tool_calls[0]"),
    (TokenizeRequest, {"prompt": "\ud800"}, "prompt"),
])
def test_a_lone_surrogate_is_refused_naming_its_field(model, body, param):
    error = _refused(model, body)
    assert error.param == param and "lone surrogate" in str(error)


def test_an_unknown_field_is_refused_and_one_of_the_other_endpoint_says_where():
    error = _refused(ChatCompletionRequest, {"messages": MESSAGES, "frobnicate": 1})
    assert (error.param, error.code) == ("frobnicate", "unknown_parameter")
    for model, body, field in (
            (ChatCompletionRequest, {"messages": MESSAGES, "prompt": "a"}, "prompt"),
            (CompletionRequest, {"prompt": "a", "tools": []}, "tools"),
            (CompletionRequest, {"prompt": "a", "top_logprobs": 1}, "top_logprobs")):
        error = _refused(model, body)
        assert (error.param, error.code) == (field, "unknown_parameter")
        assert model.other is not None and model.other.path in str(error)


def test_echo_on_chat_is_taken_at_its_default_and_refused_otherwise():
    """docs/serving.md: vLLM's chat `echo` (the answer prefixed with the last message) is
    refused unless at its default."""
    for default in (False, None):
        ChatCompletionRequest.parse({"messages": MESSAGES, "echo": default})
    error = _refused(ChatCompletionRequest, {"messages": MESSAGES, "echo": True})
    assert (error.param, error.code) == ("echo", "unsupported_parameter")


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_a_refused_field_is_taken_at_its_default_and_refused_otherwise(field):
    for default in REFUSED[field]:
        ChatCompletionRequest.parse({"messages": MESSAGES, field: default})
    error = _refused(ChatCompletionRequest, {"messages": MESSAGES, field: "something"})
    assert (error.param, error.code) == (field, "unsupported_parameter")


def test_tools_and_tool_calls_reach_the_template_whole():
    call = {"id": "c", "type": "function", "function": {"name": "a", "arguments": "{\"x\": 1}"}}
    request = ChatCompletionRequest.parse({"messages": [
        *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "1", "name": "a"}], "tools": [TOOL]})
    assert request.options.tools == (TOOL,) and request.options.tool_choice == "auto"
    # As sent, in the client's order: the template's `tojson` writes them so.
    (tool,) = request.options.tools
    assert list(tool) == list(TOOL) and list(tool["function"]) == list(TOOL["function"])
    assert request.options.template_tools == (TOOL,)
    assert request.template_messages()[1:] == [
        {"role": "assistant", "content": "",
         "tool_calls": [{**call, "function": {"name": "a", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "1", "tool_call_id": "c", "name": "a"}]
    shown = ChatCompletionRequest.parse({"messages": MESSAGES, "tools": [TOOL],
                                         "tool_choice": "none"})
    assert shown.options.template_tools == ()


def test_what_vllm_defaults_may_be_left_out_or_null():
    """vLLM's defaults: a tool's and a named tool_choice's `type` ("function"), a function's
    `parameters` null (no arguments), `documents` empty."""
    tool = {"function": {"name": "f", "parameters": None}}
    request = ChatCompletionRequest.parse({"messages": MESSAGES, "tools": [tool],
                                           "tool_choice": {"function": {"name": "f"}},
                                           "documents": []})
    (given,) = request.options.tools  # the template gets vLLM's form: the type first
    assert given == {"type": "function", **tool} and list(given)[0] == "type"
    assert request.options.tool_choice == "f"
    for wrong in ({"type": "retrieval", "function": {"name": "f"}},
                  {"function": {"name": "f", "parameters": "none"}}):
        error = _refused(ChatCompletionRequest, {"messages": MESSAGES, "tools": [wrong]})
        assert error.param is not None and error.param.startswith("tools"), error.param
    error = _refused(ChatCompletionRequest, {"messages": MESSAGES, "documents": [{"a": 1}]})
    assert (error.param, error.code) == ("documents", "unsupported_parameter")


def test_token_ids_at_or_past_the_vocabulary_are_refused():
    for field, value in (("logit_bias", {"384": 1}), ("stop_token_ids", [384])):
        ChatCompletionRequest.parse({"messages": MESSAGES, field: value})
        error = _refused(ChatCompletionRequest, {"messages": MESSAGES, field: value}, 384)
        assert error.param == field and "384" in str(error)
    request = ChatCompletionRequest.parse({"messages": MESSAGES, "logit_bias": {
        "7": 500, "3": -1.5}}, vocab_size=384)
    assert request.options.logit_bias == ((3, -1.5), (7, 100.0))


def test_tokenize_and_detokenize_bodies():
    text = TokenizeRequest.parse({"prompt": "a", "add_special_tokens": False})
    assert text.template_messages() is None and not text.add_special_tokens
    chat = TokenizeRequest.parse({"messages": MESSAGES, "tools": [TOOL]})
    assert chat.template_messages() == MESSAGES and chat.template_tools() == [TOOL]
    assert _refused(TokenizeRequest, {"messages": MESSAGES, "add_special_tokens": True}
                    ).param == "add_special_tokens"
    assert _refused(TokenizeRequest, {"messages": MESSAGES, "tools": [{"type": "x"}]}
                    ).param == "tools"
    assert _refused(TokenizeRequest, {"prompt": "a", "frobnicate": "x"}).code == \
        "unknown_parameter"
    continued = TokenizeRequest.parse({"messages": MESSAGES, "continue_final_message": True,
                                       "chat_template_kwargs": {"enable_thinking": False}})
    assert continued.chat.continue_final_message and not continued.chat.add_generation_prompt
    assert continued.chat.variables == {"enable_thinking": False}
    assert _refused(TokenizeRequest, {"messages": MESSAGES, "continue_final_message": True,
                                      "add_generation_prompt": True}
                    ).param == "continue_final_message"
    assert DetokenizeRequest.parse({"tokens": [1, 2]}, vocab_size=3).tokens == [1, 2]
    assert _refused(DetokenizeRequest, {"tokens": [3]}, 3).param == "tokens"
    assert _refused(DetokenizeRequest, {"tokens": [True]}, 3).param == "tokens"


def test_the_known_fields_are_the_models_fields_and_the_refused_ones():
    assert "messages" in KNOWN_FIELDS and "prompt" in KNOWN_FIELDS and "best_of" in KNOWN_FIELDS
    assert KNOWN_FIELDS == (set(ChatCompletionRequest.model_fields)
                            | set(CompletionRequest.model_fields) | set(REFUSED))


# Values of every JSON type and some edges, for the fuzzing below.
_VALUES = [None, True, False, 0, -1, 1, 2, 17, 10**30, -(10**30), 0.5, 1e308, -1e308,
           float("inf"), "", "x", "\ud800", "42", [], [1], ["a"], [[1]], [None], {},
           {"a": 1}, {"type": "function"}, {"type": "json_schema", "json_schema": 3},
           [{"role": "user"}], [{"role": "user", "content": [None]}], {"5": "1"}]


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest, TokenizeRequest,
                                   DetokenizeRequest])
def test_no_body_makes_anything_but_a_request_error(model):
    """Every field given every kind of value, alone and in random pairs: a request or a
    RequestError, never another exception (which the server would answer with a 500)."""
    rng = random.Random(0)
    names = sorted(model.model_fields) + ["unknown", "best_of"]
    base = {"messages": MESSAGES} if "messages" in model.model_fields else {}
    bodies = [{**base, name: value} for name in names for value in _VALUES]
    bodies += [{**base, **dict(rng.sample([(name, rng.choice(_VALUES)) for name in names], 2))}
               for _ in range(300)]
    bodies += list(_VALUES)
    for body in bodies:
        try:
            request = model.parse(json.loads(json.dumps(body)), vocab_size=384)
        except RequestError as error:
            assert error.status == 400 and str(error)
        else:
            if hasattr(request, "options"):
                assert isinstance(request.options, RequestOptions)


def test_truncation_to_the_context_leaves_room_for_min_tokens():
    """`truncate_prompt_tokens: -1` keeps what the context leaves after the output, which is
    at least `min_tokens` long: the request is then served, not refused for its min_tokens."""
    from onnx_chunk.serve.prompts import check_room, kept

    request = CompletionRequest.parse({"prompt": [1] * 200, "truncate_prompt_tokens": -1,
                                       "min_tokens": 8})
    assert kept(request, 100) == 92
    check_room(92, 100, request.options)
    with pytest.raises(RequestError) as caught:
        check_room(93, 100, request.options)
    assert caught.value.param == "min_tokens"
