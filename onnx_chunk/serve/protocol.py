"""The OpenAI request bodies the server takes, checked at the edge; its error bodies.

Pure functions (no ONNX Runtime, no HTTP): a decoded JSON body in, a `GenerationParams` or a
`RequestError` out. Rules:
1. `messages` (chat) is a non-empty list of {"role": str, "content": str or a list of text
   parts}; `prompt` (completions) is a string, a list of token ids, or a list of up to
   MAX_PROMPTS of either (several prompts: a choice per prompt and `n`).
2. `max_tokens` (or chat's `max_completion_tokens`, which wins unless it is null) is an
   integer >= 1 (0 on completions with `echo`: the prompt's logprobs alone), or absent (then
   the room left in the context); `temperature` a number in [0, 2]; `top_p` a number in
   (0, 1]; `seed` an integer >= 0; `stop` a string or up to 4 strings; `n` an integer in
   [1, MAX_N]; `stream` a boolean; `stream_options.include_usage` a boolean.
3. Booleans are not numbers; the sampling, structured-output and tool fields, the fields
   refused until they are built, and unknown fields are read by `parameters.parse_options`.
   Messages keep their tool fields (`tool_calls`, `tool_call_id`, `name`; see tools.py).
4. Text (prompt, roles, contents, stop strings) must be encodable as UTF-8: JSON's `\ud800`
   escapes can spell a lone surrogate, which is no text (refused, naming the field).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from onnx_chunk.errors import InputError

MAX_STOPS = 4
# The most choices per prompt (`n`) and prompts per request: each is one engine request.
MAX_N = 16
MAX_PROMPTS = 64
_REFUSED = ("functions",)
# Other servers' names of the length field (llama.cpp's: -1 is no limit; OpenAI Responses').
_LENGTH_ALIASES = ("n_predict", "max_output_tokens")


class RequestError(InputError):
    """A request the server refuses, in OpenAI's error shape: HTTP `status`, `type`, the
    offending `param` and a `code`."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status
        self.error_type = error_type


@dataclass(frozen=True)
class GenerationParams:
    """One checked request: its prompt (text or token ids; chat: its messages) and options."""

    prompt: str | tuple[int, ...] = ""
    # Every prompt of a completions request (`prompt` is the first).
    prompts: tuple[str | tuple[int, ...], ...] = ()
    messages: tuple[Mapping[str, str], ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    n: int = 1


def error_body(message: str, error_type: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def parse_chat(body: object) -> GenerationParams:
    """A /v1/chat/completions body, checked (see the module docstring)."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"'messages' must be a non-empty list of messages, got "
                           f"{_shown(messages)}", param="messages")
    param, max_tokens = _length(body, ("max_completion_tokens", "max_tokens"))
    return _params(body, _max_tokens(max_tokens, param), messages=tuple(
        _message(message, index) for index, message in enumerate(messages)))


def parse_completion(body: object) -> GenerationParams:
    """A /v1/completions body, checked (see the module docstring)."""
    body = _object(body)
    if body.get("best_of") not in (None, 1):
        raise RequestError("best_of other than 1 is not supported", param="best_of")
    prompts = _prompts(body.get("prompt"))
    echo = body.get("echo") is True
    param, max_tokens = _length(body, ("max_tokens",))
    return _params(body, _max_tokens(max_tokens, param, minimum=0 if echo else 1),
                   prompt=prompts[0], prompts=prompts)


def _length(body: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str, object]:
    """The length field the body sets and its value: the first of `names` that is not null
    (chat's `max_completion_tokens` wins over `max_tokens`), or one of the aliases (400 when
    an alias comes beside another length field)."""
    param = next((name for name in names if body.get(name) is not None), names[-1])
    aliases = [name for name in _LENGTH_ALIASES if body.get(name) is not None]
    if aliases:
        if body.get(param) is not None or len(aliases) > 1:
            other = param if body.get(param) is not None else aliases[0]
            raise RequestError(f"'{other}' and '{aliases[-1]}' both set the output's length; "
                               "send one of them", param=aliases[-1])
        param = aliases[0]
    value = body.get(param)
    if param == "n_predict" and value == -1 and not isinstance(value, bool):
        return param, None
    return param, value


def _object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_shown(body)}")
    for name in _REFUSED:
        if body.get(name) not in (None, False, 0, []):
            raise RequestError(f"'{name}' is not supported by this server; leave it out",
                               param=name, code="unsupported_parameter")
    return body


def _params(body: Mapping[str, Any], max_tokens: int | None, *,
            prompt: str | tuple[int, ...] = "",
            prompts: tuple[str | tuple[int, ...], ...] = (),
            messages: tuple[Mapping[str, str], ...] = ()) -> GenerationParams:
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not _integer(n) or not 1 <= n <= MAX_N:
        raise RequestError(f"'n' must be an integer in [1, {MAX_N}] (choices per prompt), got "
                           f"{_shown(n)}", param="n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"'model' must be a string, got {_shown(model)}", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be a boolean, got {_shown(stream)}", param="stream")
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise RequestError(f"'stream_options' must be an object, got {_shown(options)}",
                           param="stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError(f"'stream_options.include_usage' must be a boolean, got "
                           f"{_shown(include_usage)}", param="stream_options")
    return GenerationParams(
        prompt=prompt, prompts=prompts, messages=messages, max_tokens=max_tokens, n=n,
        temperature=_number(body.get("temperature"), "temperature", "in [0, 2]",
                            lambda value: 0 <= value <= 2),
        top_p=_number(body.get("top_p"), "top_p", "in (0, 1]", lambda value: 0 < value <= 1),
        seed=_seed(body.get("seed")), stop=_stops(body.get("stop")), stream=stream,
        include_usage=include_usage, model=model)


def _message(message: object, index: int) -> Mapping[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object with 'role' and 'content', got "
                           f"{_shown(message)}", param=where)
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise RequestError(f"{where}.role must be a non-empty string, got {_shown(role)}",
                           param=f"{where}.role")
    _text(role, f"{where}.role")
    if role == "assistant" and message.get("tool_calls") and content is None:
        content = ""
    if isinstance(content, list):
        content = "".join(_text_part(part, f"{where}.content[{number}]")
                          for number, part in enumerate(content))
    if not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of text parts, got "
                           f"{_shown(content)}", param=f"{where}.content")
    from onnx_chunk.serve.tools import tool_fields  # tools.py reads this module's errors

    return {"role": role, "content": _text(content, f"{where}.content"),
            **tool_fields(message, where)}


def _text_part(part: object, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" \
            or not isinstance(part.get("text"), str):
        raise RequestError(f"{where} must be a text part {{'type': 'text', 'text': str}} "
                           f"(this server reads text only), got {_shown(part)}", param=where)
    return _text(part["text"], where)


def _prompts(prompt: object) -> tuple[str | tuple[int, ...], ...]:
    """A prompt, or a list of prompts (strings or token-id lists)."""
    if isinstance(prompt, list) and prompt and all(isinstance(item, (str, list))
                                                   for item in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise RequestError(f"'prompt' holds {len(prompt)} prompts, more than the "
                               f"{MAX_PROMPTS} a request may; split it", param="prompt")
        return tuple(_prompt(item) for item in prompt)
    return (_prompt(prompt),)


def _prompt(prompt: object) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("'prompt' must not be empty", param="prompt")
        return _text(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(
            _integer(item) and item >= 0 for item in prompt):
        return tuple(prompt)
    raise RequestError(f"'prompt' must be a non-empty string or a list of token ids "
                       f"(integers >= 0), or a list of those, got {_shown(prompt)}",
                       param="prompt")


def _max_tokens(value: object, param: str, minimum: int = 1) -> int | None:
    if value is None:
        return None
    if not _integer(value) or value < minimum:
        extra = "" if minimum else " (0: the prompt's logprobs alone, with echo)"
        raise RequestError(f"'{param}' must be an integer >= {minimum}{extra}, got "
                           f"{_shown(value)}", param=param)
    return value


def _number(value: object, name: str, expected: str, valid) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not valid(value):
        raise RequestError(f"'{name}' must be a number {expected}, got {_shown(value)}",
                           param=name)
    return float(value)


def _seed(value: object) -> int | None:
    if value is None:
        return None
    if not _integer(value) or value < 0:
        raise RequestError(f"'seed' must be an integer >= 0, got {_shown(value)}", param="seed")
    return value


def _stops(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(
            isinstance(stop, str) and stop for stop in stops):
        raise RequestError(f"'stop' must be a non-empty string or a list of at most "
                           f"{MAX_STOPS} of them, got {_shown(value)}", param="stop")
    return tuple(_text(stop, "stop") for stop in stops)


def _text(value: str, param: str) -> str:
    """`value`, when it is text (no lone surrogate: JSON's escapes can spell one)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(f"'{param}' holds a lone surrogate (\\u{ord(value[error.start]):04x} "
                           f"at character {error.start}), which is not text; escape a "
                           "character outside the BMP as a surrogate pair, or send it as "
                           "UTF-8", param=param) from error
    return value


def _integer(value: object) -> TypeGuard[int]:
    """Whether `value` is an integer, booleans not counted."""
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: object) -> str:
    """A value as an error message shows it: its JSON type and a short repr."""
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({_json_type(value)})"


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Sequence):
        return "array"
    return "object"
