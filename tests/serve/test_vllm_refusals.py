"""What vLLM's fields refuse, and the server's answers to a template's failures: each a 400 in
OpenAI's shape naming the field to change (the live server on the Qwen3 export)."""

from __future__ import annotations

import logging
import time

import pytest

from onnx_chunk.text.chat_template import ChatTemplate
from onnx_chunk.text.tokenizer import tokenizer_of
from tests.serve.conftest import exchange

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def _refused(live, path: str, body: dict | bytes, param: str | None,
             code: str | None = None) -> str:
    status, _, answer = exchange(live, "POST", path, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error["message"]


@pytest.fixture
def model_template(live, monkeypatch):
    """Swap the live model's chat template for one source."""
    tokenizer = tokenizer_of(live.runtime)

    def swap(source: str) -> None:
        template = ChatTemplate(source, tokenizer.special_tokens.template_variables(), "a test")
        monkeypatch.setitem(tokenizer.__dict__, "chat_template", template)
    return swap


ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.append({'role': 'system', 'content': 'obey'}) }}",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_a_sandbox_escape_in_the_request_template_is_a_400_naming_it(trusting, source, caplog):
    with caplog.at_level(logging.ERROR, logger="onnx_chunk.serve.app"):
        message = _refused(trusting, CHAT, {"messages": USER, "chat_template": source},
                           "chat_template", "chat_template_sandbox")
    assert "SecurityError" in message and not caplog.records


def test_a_request_template_is_refused_unless_the_server_trusts_them(live, trusting):
    """vLLM's rule (vllm/entrypoints/openai/serving_engine.py, `_validate_chat_template`): a
    template is code, so a request's own renders only on a server started with
    --trust-request-chat-template; /tokenize follows the same rule."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    message = _refused(live, CHAT, {"messages": USER, "chat_template": template},
                       "chat_template", "untrusted_chat_template")
    assert "--trust-request-chat-template" in message
    status, _, answer = exchange(live, "POST", "/tokenize",
                                 {"messages": USER, "chat_template": template})
    assert status == 400 and answer["error"]["param"] == "chat_template"
    status, _, answer = exchange(trusting, "POST", "/tokenize",
                                 {"messages": USER, "chat_template": template})
    assert status == 200 and answer["count"] > 0


@pytest.mark.parametrize("source", [
    "{{ 'a' * 3 * 10**8 }}",
    "{{ 2 ** (2 ** 30) }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}{{ ns.s | length }}",
])
def test_a_trusted_template_cannot_make_a_value_too_large_to_hold(trusting, source):
    """The sandbox bounds `*`, `**` and `+` before they run: refused at once, no gigabytes."""
    started = time.perf_counter()
    message = _refused(trusting, CHAT, {"messages": USER, "chat_template": source},
                       "chat_template", "chat_template_sandbox")
    assert "a template may make" in message and time.perf_counter() - started < 5


@pytest.mark.parametrize("source", ESCAPES)
def test_a_sandbox_escape_in_the_models_template_is_a_400_naming_the_messages(
        live, model_template, source):
    model_template(source)
    _refused(live, CHAT, {"messages": USER}, "messages", "chat_template_sandbox")
    status, _, answer = exchange(live, "POST", "/tokenize", {"messages": USER})
    assert status == 400 and answer["error"]["param"] == "messages"


def test_a_request_template_that_fails_is_the_clients_fault(trusting):
    live = trusting
    assert "does not compile" in _refused(live, CHAT, {"messages": USER,
                                                       "chat_template": "{% for %}"},
                                          "chat_template", "invalid_chat_template")
    _refused(live, CHAT, {"messages": USER, "chat_template": "{{ messages[0].content + 1 }}"},
             "chat_template", "chat_template_failed")
    _refused(live, CHAT, {"messages": USER,
                          "chat_template": "{{ raise_exception('no system role') }}"},
             "chat_template")


def test_a_rendering_of_no_token_is_a_400_naming_whose_template_made_it(trusting,
                                                                         model_template):
    _refused(trusting, CHAT, {"messages": USER, "chat_template": "{{ '' }}"}, "chat_template")
    model_template("{% for m in messages %}{% endfor %}")
    assert "no token" in _refused(trusting, CHAT, {"messages": USER}, "messages")


def test_template_variables_that_break_the_models_template_are_named(live, model_template):
    model_template("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ 1 + (bonus or 0) }}")
    assert exchange(live, "POST", CHAT, {"messages": USER, "max_tokens": 1})[0] == 200
    _refused(live, CHAT, {"messages": USER, "chat_template_kwargs": {"bonus": "x"}},
             "chat_template_kwargs", "chat_template_failed")


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "raise_exception",
                                  "range", "tools"])
def test_a_template_variable_the_renderer_sets_is_refused(live, name):
    _refused(live, CHAT, {"messages": USER, "chat_template_kwargs": {name: 1}},
             f"chat_template_kwargs.{name}")


def test_continuing_a_message_is_refused_where_it_cannot_be(live, trusting):
    _refused(live, CHAT, {"messages": USER, "continue_final_message": True,
                          "add_generation_prompt": True}, "continue_final_message")
    _refused(trusting, CHAT, {"messages": USER, "continue_final_message": True,
                              "chat_template": "{% for m in messages %}X{% endfor %}"},
             "continue_final_message")


@pytest.mark.parametrize("bias", [
    b'{"prompt": "a", "logit_bias": {"42": 1, "042": 2}}',
    b'{"prompt": "a", "logit_bias": {"42": 1, "42": 2}}',
])
def test_a_token_id_named_twice_in_logit_bias_is_a_400_naming_it(live, bias):
    assert "twice" in _refused(live, COMPLETIONS, bias, "logit_bias")


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"384": 1}), ("stop_token_ids", [384]), ("allowed_token_ids", [3, 384])])
def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_field(live, field, value):
    assert "384" in _refused(live, COMPLETIONS, {"prompt": "a", field: value}, field)


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"truncate_prompt_tokens": 2048}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [2], "min_tokens": 1, "stop_token_ids": [2], "max_tokens": 3},
     "allowed_token_ids"),
    ({"bad_words": ["   "]}, "bad_words"),
    ({"bad_words": [""]}, "bad_words"),
    ({"response_format": {"type": "json_object"}, "allowed_token_ids": [5]},
     "allowed_token_ids"),
    ({"response_format": {"type": "json_object"}, "bad_words": ["a"]}, "bad_words"),
    ({"typical_p": 0}, "typical_p"),
    ({"seed": 2 ** 63}, "seed"),
    ({"temperature": 2.5}, "temperature"),
])
def test_vllms_rules_over_its_fields(live, body, param):
    _refused(live, COMPLETIONS, {"prompt": "a", **body}, param)


@pytest.mark.parametrize("field, value", [("top_k", 10 ** 18), ("seed", -5), ("seed", -1),
                                          ("repetition_penalty", 1e300), ("typical_p", 1)])
def test_values_vllm_takes_are_taken(live, field, value):
    status, _, answer = exchange(live, "POST", COMPLETIONS, {
        "prompt": "a", "max_tokens": 2, "temperature": 1.0, field: value})
    assert status == 200, answer
