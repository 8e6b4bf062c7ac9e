"""Tool calls out of a model's whole output: the Hermes/Qwen form (tool_choice auto) and
forced calls (required, named); the schema a forced call is generated under."""

from __future__ import annotations

import json

import pytest

from onnx_chunk.serve.protocol import RequestError
from onnx_chunk.serve.tools import call_schema, check_auto, tool_message

TOOLS = [{"type": "function", "function": {"name": "a", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
         {"type": "function", "function": {"name": "b"}}]


def _arguments(call):
    return json.loads(call["function"]["arguments"])


def test_hermes_calls_are_parsed_and_the_rest_is_content():
    text = ('Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    message, reason = tool_message(text, "stop", "auto")
    assert reason == "tool_calls" and message["content"] == "Let me look."
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["a", "b"]
    assert _arguments(message["tool_calls"][0]) == {"x": 1}
    assert len({call["id"] for call in message["tool_calls"]}) == 2


@pytest.mark.parametrize("text", ["no calls here", "<tool_call>{not json}</tool_call>",
                                  '<tool_call>["a"]</tool_call>', "<tool_call>{\"name\": 1}"])
def test_text_without_a_parsable_call_stays_content(text):
    assert tool_message(text, "stop", "auto") == ({"role": "assistant", "content": text}, "stop")


def test_a_cut_output_is_not_read_as_a_call():
    text = '{"name": "a", "arguments": {"x": 1'
    assert tool_message(text, "length", "required")[1] == "length"
    # A stop string can cut a forced call before the grammar completes it.
    assert tool_message(text, "stop", "required") == (
        {"role": "assistant", "content": text}, "stop")


def test_forced_calls():
    message, reason = tool_message('{"name": "a", "arguments": {"x": 2}}', "stop", "required")
    assert reason == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "a"
    named, _ = tool_message('{"x": 3}', "stop", "a")
    assert _arguments(named["tool_calls"][0]) == {"x": 3}


def test_call_schemas():
    assert call_schema(TOOLS, "a") == TOOLS[0]["function"]["parameters"]
    assert call_schema(TOOLS, "b")["additionalProperties"] is False
    required = call_schema(TOOLS, "required")["anyOf"]
    assert [option["properties"]["name"] for option in required] == [{"const": "a"},
                                                                     {"const": "b"}]


def test_auto_needs_a_hermes_template():
    check_auto("... <tool_call> ...")
    for source in (None, "{{ messages }}"):
        with pytest.raises(RequestError, match="Hermes"):
            check_auto(source)
