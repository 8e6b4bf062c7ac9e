"""Function tools in the OpenAI dialect: messages' tool fields, forced calls, Hermes parsing.

- `tools` go to the chat template as transformers passes them (`tools=`), and assistant
  messages' `tool_calls` reach it with their `arguments` as objects (as vLLM gives them), a
  tool message with its `tool_call_id` (requests.py's `ChatMessage` checks them).
- `tool_choice` "required" or a named function: the output is generated under a JSON schema
  (one call: {"name", "arguments"} over the tools for "required", the function's parameters
  for a named one), so it always parses into one call; answered as `tool_calls` with
  finish_reason "tool_calls".
- "auto": the model writes free text, and the Hermes/Qwen form `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` is parsed out of it (a block that does not parse stays in
  the content). A model whose chat template does not use that form is refused (400) for
  "auto"; "none" generates text with no tools shown to the model.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from onnx_chunk.serve.protocol import RequestError

HERMES_TAG = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def call_schema(tools: Sequence[Mapping[str, Any]], choice: str) -> dict[str, Any]:
    """The JSON schema a forced call is generated under ("required" or a function's name)."""
    if choice != "required":
        return _parameters(_function(tools, choice))
    return {"anyOf": [{"type": "object", "properties": {
        "name": {"const": tool["function"]["name"]},
        "arguments": _parameters(tool["function"])},
        "required": ["name", "arguments"], "additionalProperties": False} for tool in tools]}


def check_auto(template_source: str | None) -> None:
    """Refuse "auto" for a model whose chat template does not write Hermes tool calls."""
    if template_source is None or HERMES_TAG not in template_source:
        raise RequestError("tool_choice 'auto' reads tool calls in the Hermes/Qwen "
                           "<tool_call>...</tool_call> form, which this model's chat template "
                           "does not use; send tool_choice 'required' or a named function",
                           param="tool_choice", code="unsupported_tool_format")


def tool_message(text: str, finish_reason: str | None, choice: str
                 ) -> tuple[dict[str, Any], str | None]:
    """The assistant message and finish reason of a tool request's whole output."""
    if choice in ("none",) or finish_reason != "stop":
        return {"role": "assistant", "content": text}, finish_reason
    if choice == "auto":
        content, calls = _hermes_calls(text)
    else:
        try:  # complete under the grammar unless a stop string cut it
            content, calls = None, [_call(*_forced(json.loads(text), choice))]
        except json.JSONDecodeError:
            content, calls = text, []
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def _forced(value: Any, choice: str) -> tuple[str, Any]:
    return (value["name"], value["arguments"]) if choice == "required" else (choice, value)


def _hermes_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls, kept, start = [], [], 0
    for block in _HERMES_BLOCK.finditer(text):
        try:
            value = json.loads(block.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            continue
        calls.append(_call(value["name"], value.get("arguments", {})))
        kept.append(text[start:block.start()])
        start = block.end()
    kept.append(text[start:])
    content = "".join(kept).strip()
    return content or None, calls


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _function(tools: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    return next(tool["function"] for tool in tools if tool["function"]["name"] == name)


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    return dict(function.get("parameters")
                or {"type": "object", "properties": {}, "additionalProperties": False})
