"""The sampling, structured-output and tool fields of an OpenAI request, checked at the edge.

Pure functions (no ONNX Runtime, no HTTP): a decoded JSON body in, `RequestOptions` or a
`RequestError` out; `requests.py`'s models (one per endpoint) hold the list of the fields each
endpoint knows and call these rules. The fields:
- honoured: OpenAI's `presence_penalty`, `frequency_penalty` (numbers in [-2, 2]),
  `logit_bias` ({"token id": bias}, clamped to [-100, 100]), `response_format` (text,
  json_object, json_schema), `tools` and `tool_choice` (chat), `logprobs` (chat: a boolean,
  with `top_logprobs` in [0, MAX_TOP_LOGPROBS]; completions: the count of most likely tokens,
  in the same range) and `echo` (completions); vLLM's `top_k` (-1 or 0: all), `min_p`,
  `repetition_penalty`, `stop_token_ids`, `ignore_eos`, `min_tokens`, `cache_salt`;
  llama.cpp's `repeat_penalty` (= repetition_penalty), `json_schema` (= a json_schema
  response_format) and `cache_prompt` (false: a fresh prefill);
- informational, no effect on the output: `user`, `metadata`, `store`, `service_tier`,
  `parallel_tool_calls` (at most one tool call is made, which either value allows),
  `request_id`;
- refused (400 naming the field) unless they hold their default (`REFUSED`): what is not
  built (`best_of` > 1, `suffix`, vLLM's `prompt_logprobs`, beam search, guided decoding,
  llama.cpp's `grammar`, `typical_p`, `logits_processors`, `priority`, ...).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onnx_chunk.errors import InputError
from onnx_chunk.sampling import Sampling
from onnx_chunk.serve.protocol import RequestError
from onnx_chunk.serve.protocol import _shown as shown
from onnx_chunk.serve.tools import call_schema

if TYPE_CHECKING:
    from onnx_chunk.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Fields refused unless they hold their default (the values listed).
REFUSED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none"),
    "prompt_logprobs": (None,), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True), "bad_words": (None, []),
    "allowed_token_ids": (None,), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
    "truncate_prompt_tokens": (None,), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "add_generation_prompt": (None, True),
    "continue_final_message": (None, False), "reasoning_effort": (None,),
    "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
    "web_search_options": (None,), "documents": (None,),
    "grammar": (None, ""), "typical_p": (None, 1, 1.0), "guided_whitespace_pattern": (None,),
    "logits_processors": (None, []), "priority": (None, 0), "guided_decoding_backend": (None,),
    "mirostat": (None, 0), "tfs_z": (None, 1, 1.0), "dry_multiplier": (None, 0, 0.0),
    "xtc_probability": (None, 0, 0.0), "penalty_last_n": (None,), "samplers": (None,),
    "n_probs": (None, 0), "return_tokens_as_token_ids": (None, False),
    "spaces_between_special_tokens": (None, True),
}
# The range of `repetition_penalty`: past it a logit divided by it overflows float32.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# The longest `cache_salt`.
MAX_SALT_CHARS = 256
TOOL_CHOICES = ("none", "auto", "required")
# The most likely tokens given per position at most (OpenAI's limit for chat).
MAX_TOP_LOGPROBS = 20

@dataclass(frozen=True)
class ResponseFormat:
    """`response_format`: the JSON schema the output follows (json_object: any object)."""

    schema: Mapping[str, Any] | bool
    name: str = "json_object"


@dataclass(frozen=True)
class RequestOptions:
    """The checked options of one request beyond its prompt and length."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    response_format: ResponseFormat | None = None
    tools: tuple[Mapping[str, Any], ...] = ()
    # "none", "auto", "required", or the name of the function to call.
    tool_choice: str = "none"
    # The most likely tokens given beside each chosen one (None: no logprobs).
    logprobs: int | None = None
    echo: bool = False
    # vLLM's: prefixes are reused only between requests of the same salt.
    cache_salt: str | None = None
    # llama.cpp's: False asks for a fresh prefill (no kept prefix is reused).
    cache_prompt: bool = True

    def end_ids(self, eos: tuple[int, ...]) -> tuple[int, ...]:
        """The ids the request ends at: its `stop_token_ids`, and `eos` unless `ignore_eos`."""
        return tuple(dict.fromkeys((*self.stop_token_ids, *(() if self.ignore_eos else eos))))

    @property
    def constrained(self) -> bool:
        """Whether the output is generated under a grammar (response_format, a forced call)."""
        return self.response_format is not None or self.tool_choice not in ("none", "auto")


def parse_options(body: Mapping[str, Any], *, chat: bool,
                  vocab_size: int | None = None) -> RequestOptions:
    """The options of a request body (see the module docstring); `vocab_size`: the model's
    (token ids at or past it are refused, naming their field)."""
    _refuse_unbuilt(body)
    tools, tool_choice = parse_tools(body) if chat else ((), "none")
    if chat and body.get("echo") not in (None, False):
        raise RequestError("'echo' belongs to /v1/completions; send the request there",
                           param="echo")
    if not chat:
        for name in ("tools", "tool_choice", "top_logprobs"):
            if body.get(name) is not None:
                raise RequestError(f"'{name}' belongs to /v1/chat/completions; send the "
                                   "request there", param=name)
    options = RequestOptions(
        top_k=_top_k(body.get("top_k")),
        min_p=_number(body, "min_p", 0, 1),
        repetition_penalty=_repetition_penalty(body),
        presence_penalty=_number(body, "presence_penalty", -2, 2) or 0.0,
        frequency_penalty=_number(body, "frequency_penalty", -2, 2) or 0.0,
        logit_bias=_logit_bias(body.get("logit_bias"), vocab_size),
        stop_token_ids=_token_ids(body.get("stop_token_ids"), vocab_size),
        ignore_eos=_boolean(body, "ignore_eos"),
        min_tokens=_count(body, "min_tokens"),
        response_format=_format(body),
        tools=tools, tool_choice=tool_choice,
        logprobs=_chat_logprobs(body) if chat else _top_count(body, "logprobs"),
        echo=_boolean(body, "echo"), cache_salt=_salt(body.get("cache_salt")),
        cache_prompt=_boolean(body, "cache_prompt", True))
    if options.constrained and (options.ignore_eos or options.min_tokens):
        name = "ignore_eos" if options.ignore_eos else "min_tokens"
        raise RequestError(f"'{name}' cannot be combined with a grammar (response_format or a "
                           "forced tool call): the grammar decides where the output ends",
                           param=name)
    if options.constrained and body.get("stop"):
        raise RequestError("'stop' cannot be combined with a grammar (response_format or a "
                           "forced tool call): a stop string would cut the JSON short",
                           param="stop")
    if options.response_format is not None and tool_choice not in ("none", "auto"):
        raise RequestError("'response_format' and a forced 'tool_choice' both constrain the "
                           "output; send one of them", param="response_format")
    return options


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat's `logprobs` (a boolean) and `top_logprobs` as one count (None: no logprobs)."""
    wanted = _boolean(body, "logprobs")
    top = _top_count(body, "top_logprobs")
    if top is not None and not wanted:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def _top_count(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RequestError(f"'{name}' must be an integer in [0, {MAX_TOP_LOGPROBS}], got "
                           f"{shown(value)}", param=name)
    return value


def _refuse_unbuilt(body: Mapping[str, Any]) -> None:
    for name, defaults in REFUSED.items():
        value = body.get(name)
        if not any(value == default and type(value) is type(default) for default in defaults):
            raise RequestError(f"'{name}' is not supported by this server; leave it out",
                               param=name, code="unsupported_parameter")


def unknown_field(name: str, elsewhere: str | None = None) -> RequestError:
    """The refusal of a field the endpoint does not know (`elsewhere`: the endpoint that
    does)."""
    if elsewhere is not None:
        return RequestError(f"'{name}' belongs to {elsewhere}; send the request there",
                            param=name, code="unknown_parameter")
    return RequestError(f"unrecognized request field {name[:60]!r}: this server does not "
                        "know it, and would not honour it; leave it out (docs/serving.md "
                        "lists the fields)", param=name[:200], code="unknown_parameter")


def alias(body: Mapping[str, Any], *names: str) -> tuple[str, Any]:
    """The one of `names` (a field and its other servers' names) the body sets (not null),
    and its value; the first name and None when none is set; 400 when several are."""
    given = [name for name in names if body.get(name) is not None]
    if len(given) > 1:
        raise RequestError(f"'{given[0]}' and '{given[1]}' mean the same; send one of them",
                           param=given[1])
    return (given[0], body[given[0]]) if given else (names[0], None)


def _format(body: Mapping[str, Any]) -> ResponseFormat | None:
    """`response_format`, or llama.cpp's `json_schema` (the schema itself)."""
    name, value = alias(body, "response_format", "json_schema")
    if name == "json_schema":
        if not isinstance(value, (dict, bool)):
            raise RequestError(f"'json_schema' must be a JSON schema (an object), got "
                               f"{shown(value)}", param="json_schema")
        return ResponseFormat(value, "response")
    return _response_format(value)


def _repetition_penalty(body: Mapping[str, Any]) -> float | None:
    name, value = alias(body, "repetition_penalty", "repeat_penalty")
    low, high = REPETITION_PENALTY_RANGE
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not low <= value <= high:
        raise RequestError(f"'{name}' must be a number in [{low}, {high}] (1 is off), got "
                           f"{shown(value)}", param=name)
    return float(value)


def _salt(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_SALT_CHARS:
        raise RequestError(f"'cache_salt' must be a non-empty string of at most "
                           f"{MAX_SALT_CHARS} characters, got {shown(value)}",
                           param="cache_salt")
    return value


def parse_tools(body: Mapping[str, Any]) -> tuple[tuple[Mapping[str, Any], ...], str]:
    """`tools` and `tool_choice`, checked (chat's; /tokenize's tools)."""
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list) or not all(_is_function_tool(tool) for tool in tools):
        raise RequestError("'tools' must be a list of {\"type\": \"function\", \"function\": "
                           "{\"name\": str, \"parameters\": object}} (function tools only), "
                           f"got {shown(tools)}", param="tools")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise RequestError("a named 'tool_choice' must be {\"type\": \"function\", "
                               f"\"function\": {{\"name\": str}}}}, got {shown(choice)}",
                               param="tool_choice")
        choice = function["name"]
        if choice not in {tool["function"]["name"] for tool in tools}:
            raise RequestError(f"'tool_choice' names the function {choice!r}, which is not "
                               "among 'tools'", param="tool_choice")
        return tuple(tools), choice
    if choice not in TOOL_CHOICES:
        raise RequestError(f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or "
                           f"{{\"type\": \"function\", ...}}, got {shown(choice)}",
                           param="tool_choice")
    if choice != "none" and not tools:
        raise RequestError(f"'tool_choice' {choice!r} needs 'tools'", param="tool_choice")
    return tuple(tools), choice


def _is_function_tool(tool: object) -> bool:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return False
    function = tool.get("function")
    return (isinstance(function, dict) and isinstance(function.get("name"), str)
            and isinstance(function.get("parameters", {}), dict))


def _response_format(value: object) -> ResponseFormat | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat({"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema") if isinstance(value, dict) else None
        if isinstance(spec, dict) and isinstance(spec.get("schema", {}), (dict, bool)):
            return ResponseFormat(spec.get("schema", {}), str(spec.get("name", "response")))
        raise RequestError("'response_format.json_schema' must be {\"name\": str, \"schema\": "
                           f"object}}, got {shown(spec)}", param="response_format")
    raise RequestError("'response_format' must be {\"type\": \"text\"}, {\"type\": "
                       "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                       f"{{...}}}}, got {shown(value)}", param="response_format")


def _top_k(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise RequestError(f"'top_k' must be an integer >= 1, or -1 or 0 for every token, got "
                           f"{shown(value)}", param="top_k")
    return max(value, 0)


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not low <= value <= high:
        raise RequestError(f"'{name}' must be a number in [{low}, {high}], got {shown(value)}",
                           param=name)
    return float(value)


def _boolean(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean, got {shown(value)}", param=name)
    return value


def _count(body: Mapping[str, Any], name: str) -> int:
    value = body.get(name, 0)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(f"'{name}' must be an integer >= 0, got {shown(value)}", param=name)
    return value


def _token_ids(value: object, vocab_size: int | None) -> tuple[int, ...]:
    if value is None:
        return ()
    limit = "" if vocab_size is None else f" below {vocab_size}"
    if not isinstance(value, list) or not all(
            isinstance(item, int) and not isinstance(item, bool) and item >= 0
            and (vocab_size is None or item < vocab_size) for item in value):
        raise RequestError(f"'stop_token_ids' must be a list of token ids (integers >= 0"
                           f"{limit}), got {shown(value)}", param="stop_token_ids")
    return tuple(value)


# A token id as a logit_bias key: ASCII digits, at most 10 of them.
_TOKEN_KEY = re.compile(r"[0-9]{1,10}")


def _logit_bias(value: object, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestError(f"'logit_bias' must be an object mapping token ids to biases, got "
                           f"{shown(value)}", param="logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and _TOKEN_KEY.fullmatch(key)) \
                or (vocab_size is not None and int(key) >= vocab_size) \
                or isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not math.isfinite(bias):
            limit = "" if vocab_size is None else f" below {vocab_size}"
            raise RequestError(f"'logit_bias' maps token ids (as strings of digits: \"42\""
                               f"{limit}) to finite numbers, got {key[:20]!r}: "
                               f"{shown(bias)}", param="logit_bias")
        pairs.append((int(key), max(-100.0, min(100.0, float(bias)))))
    return tuple(sorted(pairs))


def request_sampling(options: RequestOptions, *, temperature: float | None,
                     top_p: float | None, seed: int | None, search: Mapping[str, Any],
                     tokenizer: Tokenizer, vocab_size: int, ends: tuple[int, ...],
                     cache_salt: str | None = None) -> Sampling:
    """The `Sampling` of a request: genai_config.json's search defaults, overridden by what the
    request sets; its grammar (response_format, a forced tool call) compiled here;
    `cache_salt`: the prefix namespace the server chose for it."""
    schema = None
    if options.response_format is not None:
        schema = options.response_format.schema
    elif options.tool_choice not in ("none", "auto"):
        schema = call_schema(options.tools, options.tool_choice)
    constraint = None
    if schema is not None:
        from onnx_chunk.structured import json_constraint

        try:
            constraint = json_constraint(tokenizer, schema, vocab_size)
        except InputError as error:
            raise RequestError(str(error), param="response_format" if options.response_format
                               else "tools") from error
    held = ends if options.min_tokens and ends else ()
    return Sampling.from_search(
        search, temperature=temperature, top_p=top_p, seed=seed, top_k=options.top_k,
        min_p=options.min_p, repetition_penalty=options.repetition_penalty,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty, logit_bias=options.logit_bias,
        min_tokens=options.min_tokens if held else 0, held_token_ids=held,
        constraint=constraint, logprobs=options.logprobs,
        prompt_logprobs=options.logprobs if options.echo else None, cache_salt=cache_salt)
