"""The parts of a request body, as pydantic models: text (valid Unicode), token ids, chat
messages with their content parts and tool calls, tools, stream options and response formats.

Strict types (a boolean is no number, a number no string); an object handed on whole to the
chat template (`OpenObject`: a tool, a call) keeps every field as sent, in the client's order,
which the template's `tojson` renders. A value a validator refuses raises `Refusal`, which
names its place (body.py turns it into the request's 400).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from onnx_chunk.serve.protocol import RequestError

TOOL_FORM = '{"type": "function", "function": {"name": str, "parameters": object}}'


class Refusal(ValueError):
    """A value a validator refuses; the refusal names the value's place (`field`: a field of
    the object the validator checks)."""

    def __init__(self, rest: str, field: str | None = None) -> None:
        super().__init__(rest)
        self.rest = rest
        self.field = field

    def error(self, param: str) -> RequestError:
        where = param if self.field is None else f"{param}.{self.field}"
        return RequestError(f"'{where}' {self.rest}", param=where)


def text_value(value: str) -> str:
    """`value`, when it is text (no lone surrogate: JSON's escapes can spell one)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise surrogate(value, error) from error
    return value


def surrogate(value: str, error: UnicodeEncodeError) -> Refusal:
    return Refusal(f"holds a lone surrogate (\\u{ord(value[error.start]):04x} at character "
                    f"{error.start}), which is not text; escape a character outside the BMP as "
                    "a surrogate pair, or send it as UTF-8")


Text = Annotated[str, AfterValidator(text_value)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(text_value)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def field(expected: str, **constraints: Any) -> Any:
    """An optional field (null: its default) that must be `expected`."""
    return Field(None, description=expected, **constraints)


class JsonObject(BaseModel):
    """A JSON object inside a request: strict types, fields it does not declare ignored."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")


class OpenObject(BaseModel):
    """A JSON object handed on whole (to the chat template): checked by its declared fields,
    kept as sent (`sent`: every field, in the client's order, which `tojson` renders)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="allow")

    _sent: dict[str, Any] = PrivateAttr()

    @model_validator(mode="wrap")
    @classmethod
    def _kept(cls, value: Any, handler: Any) -> Any:
        checked = handler(value)
        checked._sent = value
        return checked

    @property
    def sent(self) -> dict[str, Any]:
        """The object as the client sent it."""
        return self._sent


def all_text(value: Any) -> Any:
    """`value` (JSON), when every string in it is text: a template renders it whole."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            text_value(item)
        elif isinstance(item, dict):
            pending += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            pending += item
    return value


class TextPart(JsonObject):
    """A content part: this server reads text parts only."""

    type: Literal["text"]
    text: Text


class FunctionCall(OpenObject):
    """An assistant's call: `arguments` is JSON text (OpenAI's) or an object."""

    name: str
    arguments: str | dict[str, Any] = "{}"

    _parsed: Any = PrivateAttr()

    @model_validator(mode="after")
    def _arguments_parse(self) -> FunctionCall:
        if not isinstance(self.arguments, str):
            self._parsed = self.arguments
            return self
        try:
            self._parsed = json.loads(self.arguments)
        except json.JSONDecodeError as error:
            raise Refusal(f"has function.arguments that are not JSON ({error})") from error
        return self

    def template_function(self) -> dict[str, Any]:
        """The function as the chat template reads it: its arguments as an object (vLLM
        gives them so), its other fields as sent."""
        return {**self.sent, "arguments": self._parsed}


class ToolCall(OpenObject):
    """One of an assistant message's `tool_calls`."""

    function: FunctionCall

    @model_validator(mode="before")
    @classmethod
    def _texts(cls, value: Any) -> Any:
        return all_text(value)

    def template_call(self) -> dict[str, Any]:
        """The call as the chat template reads it (its other fields kept)."""
        return {**self.sent, "function": self.function.template_function()}


MESSAGE_FORM = "an object with 'role' and 'content'"
PART_FORM = "a text part {'type': 'text', 'text': str} (this server reads text only)"
CALL_FORM = '{"type": "function", "function": {"name": str, "arguments": str}}'


class ChatMessage(JsonObject):
    """One message of `messages`; its other fields are ignored."""

    role: Annotated[str, Field(min_length=1, description="a non-empty string"),
                    AfterValidator(text_value)]
    content: Text | list[TextPart] | None = field("a string or a list of text parts")
    tool_calls: list[ToolCall] | None = field("a list of tool calls, on an assistant message")
    tool_call_id: Text | None = field("a string")
    name: Text | None = field("a string")
    reasoning: Text | None = field("a string, on an assistant message")
    reasoning_content: Text | None = field("a string, on an assistant message")

    @model_validator(mode="after")
    def _tool_rules(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise Refusal("is for an assistant message's calls", "tool_calls")
        for name in ("reasoning", "reasoning_content"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise Refusal("is for an assistant message's reasoning", name)
        if self.role == "tool" and self.tool_call_id is None:
            raise Refusal("is required on a tool message: the id of the call it answers",
                           "tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise Refusal("must be a string or a list of text parts, got None (null)",
                           "content")
        return self

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined by newlines (vLLM's
        `_parse_chat_message_content_parts`, vllm/entrypoints/chat_utils.py), tool calls'
        arguments as objects, an assistant's reasoning under both names (as vLLM's
        chat_utils gives it: Qwen3's template reads `reasoning_content`)."""
        content = self.content
        if isinstance(content, list):  # one line each, as vLLM's chat_utils joins them
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.template_call() for call in self.tool_calls]
        for name in ("tool_call_id", "name"):
            value = getattr(self, name)
            if value is not None:
                message[name] = value
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        return message


class StreamOptions(JsonObject):
    """vLLM's: `include_usage` (default true, as vLLM's) adds a last chunk with the usage;
    `continuous_usage_stats` gives every chunk the usage so far too. No other key."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class FunctionDefinition(OpenObject):
    name: str
    # null or absent: a function of no arguments (vLLM's default, None).
    parameters: dict[str, Any] | None = {}


class Tool(OpenObject):
    """A function tool, handed to the chat template whole (its `type` may be left out: the
    template gets "function" first, as vLLM's `model_dump` gives it)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition

    @model_validator(mode="before")
    @classmethod
    def _texts(cls, value: Any) -> Any:
        return all_text(value)

    @property
    def sent(self) -> dict[str, Any]:
        return self._sent if "type" in self._sent else {"type": self.type, **self._sent}


class _FunctionName(JsonObject):
    name: str


class NamedToolChoice(JsonObject):
    type: Literal["function"] = "function"
    function: _FunctionName


class TextFormat(JsonObject):
    type: Literal["text"]


class JsonObjectFormat(JsonObject):
    type: Literal["json_object"]


class JsonSchemaSpec(JsonObject):
    name: str = "response"
    schema_: dict[str, Any] | bool = Field({}, alias="schema")


class JsonSchemaFormat(JsonObject):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec
