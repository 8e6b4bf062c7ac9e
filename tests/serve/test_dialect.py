"""The OpenAI dialect through the official openai client: every sampling option honoured,
structured output, tools, the refused fields, /tokenize and /detokenize (live server on a
real export; random weights: greedy output is whatever the logits say, so each test
checks an option by what it must change)."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from onnx_chunk.runtime import load
from onnx_chunk.sampling import Sampling
from onnx_chunk.text.generation import generate_text
from tests.serve.conftest import EXPORT, MODEL_NAME, exchange, live_server

EOS = "4"  # genai_config's eos_token_id of the export
USER = [{"role": "user", "content": "Tell me about Paris."}]
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "people": {"type": "integer", "minimum": 0, "maximum": 9999},
    "sights": {"type": "array", "items": {"enum": ["tower", "museum", "river"]},
               "maxItems": 3}},
    "required": ["city", "people", "sights"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"], "additionalProperties": False}}}
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"]
              for tool in (WEATHER, TIME)}
# A chat template writing Hermes/Qwen tool calls, with the tools in a system block.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _chat(live, **options):
    return live.client().chat.completions.create(model=MODEL_NAME, messages=USER, **options)


def _complete(live, **options):
    return live.client().completions.create(model=MODEL_NAME, prompt="Paris is",
                                            **options)


def _refusal(live, path: str, body: dict) -> dict:
    status, _, answer = exchange(live, "POST", path, {"model": MODEL_NAME, **body})
    assert status == 400, answer
    return answer["error"]


# Structured output.

def test_json_schema_output_validates_for_every_seed(live):
    for seed in range(12):
        answer = _chat(live, max_tokens=150, temperature=1.0, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)


def test_streamed_json_schema_output_validates(live):
    for seed in range(4):
        chunks = list(_chat(live, max_tokens=150, temperature=1.0, seed=seed, stream=True,
                            response_format={"type": "json_schema",
                                             "json_schema": {"name": "c", "schema": SCHEMA}}))
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_schema_on_completions(live):
    answer = _complete(live, max_tokens=150, temperature=1.0, seed=1, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "c",
                                                                   "schema": SCHEMA}}})
    jsonschema.validate(json.loads(answer.choices[0].text), SCHEMA)


def test_json_object_mode_answers_an_object(live):
    objects = 0
    for seed in range(6):
        answer = _chat(live, max_tokens=200, temperature=1.0, seed=seed,
                       response_format={"type": "json_object"})
        if answer.choices[0].finish_reason == "stop":
            objects += 1
            assert isinstance(json.loads(answer.choices[0].message.content), dict)
    assert objects


@pytest.mark.parametrize("response_format, fragment", [
    ({"type": "xml"}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "schema"),
    ({"type": "json_schema"}, "json_schema"),
])
def test_bad_response_format_is_refused(live, response_format, fragment):
    error = _refusal(live, "/v1/chat/completions",
                     {"messages": USER, "response_format": response_format})
    assert error["param"] == "response_format" and fragment in error["message"]


# Tools.

@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_makes_a_valid_call(live, stream):
    for seed in range(6):
        options = dict(max_tokens=150, temperature=1.0, seed=seed, tools=[WEATHER, TIME],
                       tool_choice="required")
        if stream:
            chunks = list(_chat(live, stream=True, **options))
            calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
            reason = chunks[-1].choices[0].finish_reason
        else:
            choice = _chat(live, **options).choices[0]
            calls, reason = choice.message.tool_calls, choice.finish_reason
        assert reason == "tool_calls" and len(calls) == 1
        call = calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_named_tool_choice_calls_that_function(live):
    for seed in range(4):
        choice = _chat(live, max_tokens=150, temperature=1.0, seed=seed, tools=[WEATHER, TIME],
                       tool_choice={"type": "function", "function": {"name": "get_time"}}
                       ).choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_time"])


def test_tool_choice_none_answers_text(live):
    plain = _chat(live, max_tokens=8, temperature=0)
    answer = _chat(live, max_tokens=8, temperature=0, tools=[WEATHER], tool_choice="none")
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content == plain.choices[0].message.content


def test_auto_is_refused_for_a_template_without_hermes_calls(live):
    error = _refusal(live, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER]})
    assert error["param"] == "tool_choice" and "<tool_call>" in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                          "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_are_refused(live, body, param):
    assert _refusal(live, "/v1/chat/completions", {"messages": USER, **body})["param"] == param


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    """The export with a chat template that shows tools and writes Hermes calls."""
    folder = tmp_path_factory.mktemp("hermes") / EXPORT.name
    shutil.copytree(EXPORT, folder)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE, encoding="utf-8")
    with load(folder, provider="cpu") as runtime, live_server(runtime) as running:
        yield running


def test_tools_reach_the_chat_template(hermes):
    def count(**extra):
        status, _, answer = exchange(hermes, "POST", "/tokenize",
                                     {"messages": USER, "return_token_strs": True, **extra})
        assert status == 200, answer
        return answer

    shown = count(tools=[WEATHER])
    assert shown["count"] > count()["count"]
    assert "get_weather" in "".join(shown["token_strs"])
    answer = hermes.client().chat.completions.create(
        model=MODEL_NAME, messages=USER, tools=[WEATHER], max_tokens=4, temperature=0)
    assert answer.usage.prompt_tokens == shown["count"]


def test_auto_on_a_hermes_template_answers(hermes):
    answer = hermes.client().chat.completions.create(
        model=MODEL_NAME, messages=USER, tools=[WEATHER], tool_choice="auto", max_tokens=6,
        temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_assistant_tool_calls_and_tool_results_reach_the_template(hermes):
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather",
                "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    status, _, answer = exchange(hermes, "POST", "/tokenize",
                                 {"messages": history, "return_token_strs": True})
    assert status == 200, answer
    text = "".join(answer["token_strs"]).replace("Ġ", " ")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "21 degrees" in text.replace("Ċ", "\n")


# Sampling options.

def test_logit_bias_forces_a_token(live):
    answer = _complete(live, max_tokens=5, temperature=0, logit_bias={"50": 100})
    assert answer.choices[0].text == "K" * 5


def test_ignore_eos_and_min_tokens(live):
    at_eos = _complete(live, max_tokens=8, temperature=0, logit_bias={EOS: 100})
    assert (at_eos.usage.completion_tokens, at_eos.choices[0].finish_reason) == (1, "stop")
    ignored = _complete(live, max_tokens=8, temperature=0, logit_bias={EOS: 100},
                        extra_body={"ignore_eos": True})
    assert (ignored.usage.completion_tokens, ignored.choices[0].finish_reason) == (8, "length")
    held = _complete(live, max_tokens=8, temperature=0, logit_bias={EOS: 100},
                     extra_body={"min_tokens": 5})
    assert (held.usage.completion_tokens, held.choices[0].finish_reason) == (6, "stop")


def test_min_tokens_defers_stop_strings(live):
    options = dict(max_tokens=8, temperature=0, logit_bias={"50": 100}, stop="K")
    assert _complete(live, **options).choices[0].text == ""
    held = _complete(live, **options, extra_body={"min_tokens": 3})
    assert held.choices[0].text == "KKK" and held.usage.completion_tokens == 4
    assert held.choices[0].finish_reason == "stop"


def test_stop_token_ids_end_the_text_without_their_text(live):
    answer = _complete(live, max_tokens=8, temperature=0, logit_bias={"50": 100},
                       extra_body={"stop_token_ids": [50]})
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == 1 and answer.choices[0].text == ""


def test_frequency_and_presence_penalties_act(live):
    # A bias of 3 on one token wins every greedy step; a penalty of 2 per use beats it.
    assert _complete(live, max_tokens=6, temperature=0, logit_bias={"50": 3}
                     ).choices[0].text == "K" * 6
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        text = _complete(live, max_tokens=6, temperature=0, logit_bias={"50": 3},
                         **penalty).choices[0].text
        assert text != "K" * 6, penalty


@pytest.mark.parametrize("extra", [{"top_k": 1}, {"min_p": 1.0}])
def test_top_k_and_min_p_narrow_the_draw(live, extra):
    greedy = _complete(live, max_tokens=10, temperature=0).choices[0].text
    for seed in range(3):
        assert _complete(live, max_tokens=10, temperature=1.0, seed=seed,
                         extra_body=extra).choices[0].text == greedy


def test_repetition_penalty_is_the_python_apis(live, served_runtime):
    answer = _complete(live, max_tokens=10, temperature=0,
                       extra_body={"repetition_penalty": 1.8})
    expected = generate_text(served_runtime, "Paris is", 10,
                             sampling=Sampling(repetition_penalty=1.8))
    plain = generate_text(served_runtime, "Paris is", 10, sampling=Sampling())
    assert answer.choices[0].text == expected.text != plain.text


def test_a_seed_repeats_a_sampled_answer(live):
    first, second = (_complete(live, max_tokens=10, temperature=1.0, seed=7).choices[0].text
                     for _ in range(2))
    assert first == second


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", "1"), ("logit_bias", {"abc": 1}),
    ("logit_bias", {"100000": 1}), ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0),
    ("stop_token_ids", [-1]), ("ignore_eos", "yes"), ("min_tokens", -1),
])
def test_bad_sampling_values_are_refused(live, field, value):
    error = _refusal(live, "/v1/completions", {"prompt": "x", field: value})
    assert field in error["message"] or error["param"] == field


@pytest.mark.parametrize("field, value", [
    ("best_of", 3), ("suffix", "end"), ("length_penalty", 2),
    ("use_beam_search", True), ("guided_json", {"type": "object"}),
])
def test_unbuilt_fields_are_refused_by_name(live, field, value):
    assert _refusal(live, "/v1/completions", {"prompt": "x", field: value})["param"] == field


def test_chat_refuses_best_of(live):
    assert _refusal(live, "/v1/chat/completions", {"messages": USER, "best_of": 2}
                    )["param"] == "best_of"


def test_chat_refuses_echo_and_top_logprobs_without_logprobs(live):
    assert _refusal(live, "/v1/chat/completions", {"messages": USER, "echo": True}
                    )["param"] == "echo"
    assert _refusal(live, "/v1/chat/completions", {"messages": USER, "top_logprobs": 2}
                    )["param"] == "top_logprobs"
    assert _refusal(live, "/v1/chat/completions", {"messages": USER, "logprobs": True,
                                                   "top_logprobs": 21})["param"] == \
        "top_logprobs"


def test_a_grammar_with_ignore_eos_is_refused(live):
    error = _refusal(live, "/v1/chat/completions", {
        "messages": USER, "ignore_eos": True, "response_format": {"type": "json_object"}})
    assert error["param"] == "ignore_eos"


# /tokenize and /detokenize.

def test_tokenize_and_detokenize_round_trip(live):
    status, _, tokens = exchange(live, "POST", "/tokenize", {"prompt": "Paris is"})
    assert status == 200 and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == live.runtime.stats.capacity and tokens["token_strs"] is None
    assert _complete(live, max_tokens=1).usage.prompt_tokens == tokens["count"]
    status, _, text = exchange(live, "POST", "/detokenize", {"tokens": tokens["tokens"]})
    assert (status, text) == (200, {"prompt": "Paris is"})


def test_tokenize_messages_counts_the_chat_prompt(live):
    status, _, tokens = exchange(live, "POST", "/tokenize", {"messages": USER})
    assert status == 200
    assert _chat(live, max_tokens=1).usage.prompt_tokens == tokens["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_tokenize_refuses_bad_bodies(live, path, body, param):
    assert _refusal(live, path, body)["param"] == param


def test_tokenize_refuses_another_model(live):
    status, _, answer = exchange(live, "POST", "/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404 and answer["error"]["param"] == "model"


def test_the_openai_client_raises_on_a_refusal(live):
    with pytest.raises(openai.BadRequestError):
        _complete(live, max_tokens=2, extra_body={"best_of": 2})
