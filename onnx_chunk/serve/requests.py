"""One request model per endpoint (pydantic, as vLLM's protocol): the body validated once.

`ChatCompletionRequest` and `CompletionRequest` declare every field their endpoint knows, so
the model's fields are the list of known fields: another field is a 400
`unknown_parameter` naming it (pydantic's `extra="forbid"`). Each field is checked by the rule
protocol.py or parameters.py states for it (booleans are not numbers, ranges, lone
surrogates, tools, ...); a refusal is a `RequestError` naming its `param`. `parsed()` gives
the request's `GenerationParams` and `RequestOptions`; `parameters.request_sampling` turns
them into its `Sampling`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, model_validator

from onnx_chunk.serve import parameters, protocol
from onnx_chunk.serve.parameters import RequestOptions
from onnx_chunk.serve.protocol import GenerationParams, RequestError

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class _Request(BaseModel):
    """The fields both generation endpoints know, each kept as JSON gave it; the model's
    validator checks them all once, by the rules of protocol.py and parameters.py (several
    read more than one field), into `params` and `options`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    chat: ClassVar[bool]
    # The endpoint, and the other one (to name it when a field belongs there).
    path: ClassVar[str]
    other: ClassVar[type[_Request]]

    model: Any = None
    n: Any = None
    stream: Any = None
    stream_options: Any = None
    max_tokens: Any = None
    n_predict: Any = None
    max_output_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    seed: Any = None
    stop: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    response_format: Any = None
    json_schema: Any = None
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    repeat_penalty: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    min_tokens: Any = None
    logprobs: Any = None
    cache_salt: Any = None
    cache_prompt: Any = None
    # Informational: no effect on the answer.
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    request_id: Any = None
    parallel_tool_calls: Any = None

    _params: GenerationParams = PrivateAttr()
    _options: RequestOptions = PrivateAttr()

    @classmethod
    def parse(cls, body: object, *, vocab_size: int | None = None) -> _Request:
        """The checked request of a decoded JSON body; RequestError naming the field (a
        field the endpoint does not know: `unknown_parameter`)."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object, got "
                               f"{protocol._shown(body)}")
        known = set(cls.model_fields) | set(parameters.REFUSED)
        unknown = sorted(name for name in body if name not in known)
        if unknown:
            name = unknown[0]
            raise parameters.unknown_field(
                name, cls.other.path if name in cls.other.model_fields else None)
        try:
            # The refused fields (kept out of the models) are checked with the whole body.
            return cls.model_validate({name: value for name, value in body.items()
                                       if name in cls.model_fields},
                                      context={"vocab_size": vocab_size, "body": body})
        except ValidationError as error:  # the rules raise RequestError; pydantic wraps it
            for detail in error.errors():
                cause = (detail.get("ctx") or {}).get("error")
                if isinstance(cause, RequestError):
                    raise cause from None
            raise RequestError(f"the request body is not valid: {error}") from error

    @model_validator(mode="wrap")
    @classmethod
    def _checked(cls, body: Any, handler: Any, info: Any) -> _Request:
        request = handler(body)
        context = info.context or {}
        vocab_size = context.get("vocab_size")
        fields = context.get("body", body if isinstance(body, dict) else {})
        request._params = (protocol.parse_chat(fields) if cls.chat
                           else protocol.parse_completion(fields))
        request._options = parameters.parse_options(fields, chat=cls.chat,
                                                    vocab_size=vocab_size)
        return request

    @property
    def params(self) -> GenerationParams:
        """The prompt, length and sampling basics (protocol.py's rules)."""
        return self._params

    @property
    def options(self) -> RequestOptions:
        """The sampling, structured-output and tool options (parameters.py's rules)."""
        return self._options


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    chat = True
    path = CHAT_PATH

    messages: Any = None
    max_completion_tokens: Any = None
    tools: Any = None
    tool_choice: Any = None
    top_logprobs: Any = None


class CompletionRequest(_Request):
    """POST /v1/completions."""

    chat = False
    path = COMPLETIONS_PATH

    prompt: Any = None
    echo: Any = None


ChatCompletionRequest.other = CompletionRequest
CompletionRequest.other = ChatCompletionRequest

# Every field a generation request may hold (anything else: 400 `unknown_parameter`).
KNOWN_FIELDS = (frozenset(ChatCompletionRequest.model_fields)
                | frozenset(CompletionRequest.model_fields) | frozenset(parameters.REFUSED))
