"""One request model per endpoint (pydantic, as vLLM's protocol): the body validated once.

`ChatCompletionRequest` and `CompletionRequest` (tokenize.py has `TokenizeRequest` and
`DetokenizeRequest`) declare every field their endpoint knows, by OpenAI's, vLLM's and
llama.cpp's names, with their types (strict: a boolean is no number, a number no string),
ranges, and what each must be (the field's description, which a refusal quotes).
`parse(body)` is the one entry; it refuses, with a `RequestError` naming the `param`:
- a body that is not a JSON object;
- a field the endpoint does not know (`unknown_parameter`; a field of the other generation
  endpoint says where it belongs), or one of parameters.REFUSED holding anything but its
  default (`unsupported_parameter`);
- a value of the wrong type or range; text that is not valid Unicode (a lone surrogate that
  JSON's escapes can spell); a message's tool fields out of place;
- the rules over several fields: one length field (chat's `max_completion_tokens` wins over
  `max_tokens` unless null; llama.cpp's `n_predict`, -1 for no limit, and Responses'
  `max_output_tokens` alone), at least 1 token (0 on completions with `echo`: the prompt's
  logprobs alone), `min_tokens` at most `max_tokens`; one of each alias pair; `tool_choice`
  naming one of `tools`; `top_logprobs` with `logprobs`; token ids below the vocabulary, each
  `logit_bias` id once; no grammar (response_format or a forced call) with `ignore_eos`,
  `min_tokens`, `stop`, `allowed_token_ids` or `bad_words`, nor two grammars;
  `prompt_logprobs` not on a stream; `continue_final_message` not with an explicit
  `add_generation_prompt: true`; no `chat_template_kwargs` name the renderer sets itself.
Every numeric sampling field takes the range of `onnx_chunk.sampling_ranges.RANGES` (vLLM's
rule). A generation request then gives its `options` (parameters.RequestOptions) and
`sampling(...)`; chat its `template_messages()` (as the chat template reads them), completions
its `prompts()`; `answer_floor(...)` is the least its logprobs make in the answer.
body.py decodes the JSON they parse (an object naming one key twice is marked, so
`logit_bias` refuses a token id named twice) and names their refusals.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    Field,
    PrivateAttr,
    ValidationInfo,
    model_validator,
)

from onnx_chunk.sampling import Sampling
from onnx_chunk.sampling_ranges import RANGES
from onnx_chunk.serve.answer_size import AnswerFloor, LogprobPart
from onnx_chunk.serve.body import Repeated, RequestModel, vocab_size_of
from onnx_chunk.serve.messages import (
    TOOL_FORM,
    ChatMessage,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    NonEmptyText,
    StreamOptions,
    Text,
    TextFormat,
    TokenId,
    TokenIds,
    Tool,
    all_text,
    field,
)
from onnx_chunk.serve.parameters import (
    MAX_SALT_CHARS,
    MAX_TOP_LOGPROBS,
    REFUSED,
    ChatFields,
    RequestOptions,
    ResponseFormat,
    refuse_unbuilt,
)
from onnx_chunk.serve.protocol import MAX_N, MAX_PROMPTS, MAX_STOPS, RequestError, shown
from onnx_chunk.text.chat_template import RESERVED_VARIABLES

if TYPE_CHECKING:
    from onnx_chunk.text.tokenizer import Tokenizer

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"



def _ranged(name: str) -> Any:
    """An optional sampling field in the range of RANGES[name] (vLLM's rule)."""
    allowed = RANGES[name]
    return Field(None, description=allowed.describe(), **allowed.constraints())


class _GenerationRequest(RequestModel):
    """The fields both generation endpoints know."""

    _length_fields: ClassVar[tuple[str, ...]] = ("max_tokens",)

    model: str | None = field("a string: the id of this server's model")
    n: int | None = field(f"an integer in [1, {MAX_N}] (choices per prompt)", ge=1, le=MAX_N)
    stream: bool | None = field("a boolean")
    stream_options: StreamOptions | None = field(
        'an object {"include_usage": boolean, "continuous_usage_stats": boolean}')
    max_tokens: int | None = field("an integer >= 1", ge=0)
    n_predict: int | None = field("an integer >= 1, or -1 for no limit", ge=-1)
    max_output_tokens: int | None = field("an integer >= 1", ge=0)
    temperature: float | None = _ranged("temperature")
    top_p: float | None = _ranged("top_p")
    seed: int | None = _ranged("seed")
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)] | None = \
        field(f"a non-empty string or a list of at most {MAX_STOPS} of them")
    presence_penalty: float | None = _ranged("presence_penalty")
    frequency_penalty: float | None = _ranged("frequency_penalty")
    logit_bias: dict[Annotated[str, Field(pattern="^[0-9]{1,10}$")],
                     Annotated[float, Field(allow_inf_nan=False)]] | None = field(
        'an object mapping token ids (as strings of digits: "42") to finite numbers')
    response_format: Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                               Field(discriminator="type")] | None = field(
        '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
        '"json_schema": {"name": str, "schema": object}}')
    json_schema: dict[str, Any] | bool | None = field("a JSON schema (an object)")
    top_k: int | None = _ranged("top_k")
    min_p: float | None = _ranged("min_p")
    typical_p: float | None = _ranged("typical_p")
    repetition_penalty: float | None = _ranged("repetition_penalty")
    repeat_penalty: float | None = _ranged("repetition_penalty")
    stop_token_ids: list[TokenId] | None = field(
        "a list of token ids (integers >= 0 below the vocabulary's size)")
    allowed_token_ids: TokenIds | None = field(
        "a non-empty list of token ids (integers >= 0 below the vocabulary's size)")
    bad_words: list[NonEmptyText] | None = field("a list of non-empty strings")
    ignore_eos: bool | None = field("a boolean")
    min_tokens: int | None = _ranged("min_tokens")
    include_stop_str_in_output: bool | None = field("a boolean")
    skip_special_tokens: bool | None = field("a boolean")
    spaces_between_special_tokens: bool | None = field("a boolean")
    truncate_prompt_tokens: int | None = field(
        "an integer >= 1 (the prompt ids kept), or -1 (as many as the context leaves)", ge=-1)
    prompt_logprobs: int | None = field(f"an integer in [0, {MAX_TOP_LOGPROBS}]", ge=0,
                                         le=MAX_TOP_LOGPROBS)
    return_tokens_as_token_ids: bool | None = field("a boolean")
    cache_salt: str | None = field(
        f"a non-empty string of at most {MAX_SALT_CHARS} characters", min_length=1,
        max_length=MAX_SALT_CHARS)
    cache_prompt: bool | None = field("a boolean")
    # Informational: no effect on the answer.
    user: Text | None = field("a string")
    metadata: dict[str, str] | None = field("an object of strings")
    store: bool | None = field("a boolean")
    service_tier: Text | None = field("a string")
    # vLLM's: the answer's id is "chatcmpl-" (chat) or "cmpl-" (completions) and this (an
    # empty one: a random id, as vLLM's).
    request_id: Text | None = field(
        f"a string of at most {MAX_SALT_CHARS} characters", max_length=MAX_SALT_CHARS)
    parallel_tool_calls: bool | None = field("a boolean")

    _options: RequestOptions = PrivateAttr()

    @classmethod
    def _refusable(cls, name: str) -> bool:
        return name in REFUSED

    @classmethod
    def _checked_refusals(cls, body: dict[str, Any]) -> dict[str, Any]:
        refuse_unbuilt(body)
        bias = body.get("logit_bias")
        if isinstance(bias, Repeated):
            raise RequestError(f"'logit_bias' names the token id {bias.repeated[:20]!r} twice; "
                               "give each token id one bias", param="logit_bias")
        return {name: value for name, value in body.items() if name not in REFUSED}

    @property
    def options(self) -> RequestOptions:
        """The request's options, checked and resolved."""
        return self._options

    def sampling(self, *, search: Mapping[str, Any], tokenizer: Tokenizer, vocab_size: int,
                 ends: tuple[int, ...], cache_salt: str | None = None) -> Sampling:
        """The request's `Sampling` (RequestOptions.sampling)."""
        return self._options.sampling(search=search, tokenizer=tokenizer,
                                      vocab_size=vocab_size, ends=ends, cache_salt=cache_salt)

    @model_validator(mode="after")
    def _resolved(self, info: ValidationInfo) -> _GenerationRequest:
        self._options = self._resolve(vocab_size_of(info))
        return self

    def _resolve(self, vocab_size: int | None) -> RequestOptions:
        """The options, by the rules over several fields (module docstring)."""
        tools, tool_choice, logprobs, echo = self._endpoint_options()
        max_tokens = self._length(minimum=0 if echo else 1)
        # vLLM refuses a non-empty stream_options without a stream (an empty object is none)
        if self.stream_options is not None and self.stream_options.model_fields_set \
                and not self.stream:
            raise RequestError("'stream_options' applies to a stream (as vLLM); send "
                               "'stream': true or leave it out", param="stream_options")
        streamed = self.stream_options if self.stream else None
        usage = streamed is not None and bool(streamed.include_usage)
        options = RequestOptions(
            max_tokens=max_tokens, n=self.n or 1,
            stream=bool(self.stream),
            include_usage=usage,
            continuous_usage=usage and bool(streamed and streamed.continuous_usage_stats),
            request_id=self.request_id or None,
            model=self.model, stop=(self.stop,) if isinstance(self.stop, str) else tuple(
                self.stop or ()),
            temperature=self.temperature, top_p=self.top_p, seed=self.seed,
            top_k=None if self.top_k is None else max(self.top_k, 0), min_p=self.min_p,
            typical_p=self.typical_p,
            repetition_penalty=self._alias("repetition_penalty", "repeat_penalty"),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=self._logit_bias(vocab_size),
            allowed_token_ids=self._token_ids("allowed_token_ids", vocab_size) or None,
            bad_words=tuple(self.bad_words or ()),
            stop_token_ids=self._token_ids("stop_token_ids", vocab_size),
            ignore_eos=bool(self.ignore_eos), min_tokens=self._min_tokens(max_tokens),
            response_format=self._format(), tools=tools, tool_choice=tool_choice,
            logprobs=logprobs, echo=echo, prompt_logprobs=self._prompt_logprobs(),
            return_tokens_as_token_ids=bool(self.return_tokens_as_token_ids),
            skip_special_tokens=self.skip_special_tokens is not False,
            spaces_between_special_tokens=self.spaces_between_special_tokens is not False,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            truncate_prompt_tokens=self._truncation(), chat=self._chat(),
            cache_salt=self.cache_salt, cache_prompt=self.cache_prompt is not False)
        for name in ("ignore_eos", "min_tokens", "allowed_token_ids", "bad_words"):
            if options.constrained and getattr(self, name):
                raise RequestError(f"'{name}' cannot be combined with a grammar (response_format "
                                   "or a forced tool call): the grammar decides which tokens "
                                   "come and where the output ends", param=name)
        if options.constrained and options.stop:
            raise RequestError("'stop' cannot be combined with a grammar (response_format or a "
                               "forced tool call): a stop string would cut the JSON short",
                               param="stop")
        if options.response_format is not None and tool_choice not in ("none", "auto"):
            raise RequestError("'response_format' and a forced 'tool_choice' both constrain the "
                               "output; send one of them", param="response_format")
        return options

    def _endpoint_options(self) -> tuple[tuple[Mapping[str, Any], ...], str, int | None, bool]:
        """The endpoint's own: tools, tool_choice, the logprobs count, echo."""
        raise NotImplementedError

    def _length(self, minimum: int) -> int | None:
        """The new tokens at most: the one length field the body sets (None: none)."""
        names = self._length_fields
        param = next((name for name in names if getattr(self, name) is not None), names[-1])
        aliases = [name for name in ("n_predict", "max_output_tokens")
                   if getattr(self, name) is not None]
        if aliases:
            if getattr(self, param) is not None or len(aliases) > 1:
                other = param if getattr(self, param) is not None else aliases[0]
                raise RequestError(f"'{other}' and '{aliases[-1]}' both set the output's "
                                   "length; send one of them", param=aliases[-1])
            param = aliases[0]
        value = getattr(self, param)
        if value is None or (param == "n_predict" and value == -1):
            return None
        if value < minimum:
            extra = "" if minimum else " (0: the prompt's logprobs alone, with echo)"
            raise RequestError(f"'{param}' must be an integer >= {minimum}{extra}, got "
                               f"{shown(value)}", param=param)
        return value

    def _alias(self, *names: str) -> Any:
        """The value of the one of `names` (a field and its other servers' names) the body
        sets; 400 when several are."""
        given = [name for name in names if getattr(self, name) is not None]
        if len(given) > 1:
            raise RequestError(f"'{given[0]}' and '{given[1]}' mean the same; send one of them",
                               param=given[1])
        return getattr(self, given[0]) if given else None

    def _format(self) -> ResponseFormat | None:
        """`response_format`, or llama.cpp's `json_schema` (the schema itself)."""
        self._alias("response_format", "json_schema")
        if self.json_schema is not None:
            return ResponseFormat(self.json_schema, "response", param="json_schema")
        value = self.response_format
        if isinstance(value, JsonObjectFormat):
            return ResponseFormat({"type": "object"})
        if isinstance(value, JsonSchemaFormat):
            return ResponseFormat(value.json_schema.schema_, value.json_schema.name)
        return None

    def _logit_bias(self, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
        pairs: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            token = int(key)
            if vocab_size is not None and token >= vocab_size:
                raise RequestError(f"'logit_bias' maps token ids (as strings of digits: \"42\" "
                                   f"below {vocab_size}, the vocabulary's size) to finite "
                                   f"numbers, got {key[:20]!r}: {shown(bias)}",
                                   param="logit_bias")
            if token in pairs:
                raise RequestError(f"'logit_bias' names the token id {token} twice (as "
                                   f"{key[:20]!r} and another spelling); give each token id "
                                   "one bias", param="logit_bias")
            pairs[token] = max(-100.0, min(100.0, bias))
        return tuple(sorted(pairs.items()))

    def _token_ids(self, name: str, vocab_size: int | None) -> tuple[int, ...]:
        ids = tuple(getattr(self, name) or ())
        outside = [token for token in ids if vocab_size is not None and token >= vocab_size]
        if outside:
            raise RequestError(f"'{name}' must be a list of token ids (integers >= 0 below "
                               f"{vocab_size}, the vocabulary's size), got {outside[0]}",
                               param=name)
        return ids

    def _min_tokens(self, max_tokens: int | None) -> int:
        """`min_tokens`, at most `max_tokens` (vLLM's rule)."""
        minimum = self.min_tokens or 0
        if max_tokens is not None and minimum > max_tokens:
            raise RequestError(f"'min_tokens' must be at most the output's length ({max_tokens}"
                               f"), got {minimum}", param="min_tokens")
        return minimum

    def _prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("'prompt_logprobs' is not given on a stream (as vLLM); send "
                               "'stream': false", param="prompt_logprobs")
        return self.prompt_logprobs

    def _truncation(self) -> int | None:
        if self.truncate_prompt_tokens == 0:
            raise RequestError("'truncate_prompt_tokens' must be an integer >= 1 (the prompt ids "
                               "kept), or -1 (as many as the context leaves), got 0",
                               param="truncate_prompt_tokens")
        return self.truncate_prompt_tokens

    def _chat(self) -> ChatFields:
        """The chat rendering fields (completions: the defaults)."""
        return ChatFields()

    _prompt_part: ClassVar[str] = "completion"

    def answer_floor(self, prompt_lengths: list[int], capacity: int) -> AnswerFloor:
        """The logprob entries of the answer to prompts of `prompt_lengths` ids, by part
        (answer_size.py): the generated tokens' and, on completions with `echo`, the
        prompts'; `prompt_logprobs`'. Generated tokens count at the length asked (the room
        left in the context when none is)."""
        options = self.options
        n, top = options.n, options.logprobs
        parts = []
        if top is not None:
            generated = sum(capacity - length if options.max_tokens is None
                            else options.max_tokens for length in prompt_lengths)
            echoed = sum(prompt_lengths) if options.echo else 0
            parts.append(LogprobPart(self._logprobs_field, self._prompt_part,
                                     (generated + echoed) * n * (1 + top)))
        if options.prompt_logprobs is not None:
            copies = 1 if self._prompt_part == "chat" else n
            parts.append(LogprobPart("prompt_logprobs", "prompt", copies * max(
                1, options.prompt_logprobs) * sum(max(length - 1, 0)
                                                  for length in prompt_lengths)))
        return AnswerFloor(tuple(parts))

    _logprobs_field: ClassVar[str] = "logprobs"


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    path = CHAT_PATH
    _length_fields = ("max_completion_tokens", "max_tokens")

    messages: Annotated[list[ChatMessage], Field(min_length=1)] = Field(
        description="a non-empty list of messages")
    max_completion_tokens: int | None = field("an integer >= 1", ge=0)
    tools: list[Tool] | None = field(f"a list of {TOOL_FORM} (function tools only)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = field(
        'one of none, auto, required or {"type": "function", "function": {"name": str}}')
    logprobs: bool | None = field("a boolean")
    top_logprobs: int | None = field(f"an integer in [0, {MAX_TOP_LOGPROBS}]", ge=0,
                                      le=MAX_TOP_LOGPROBS)
    chat_template: NonEmptyText | None = field("a Jinja chat template (a non-empty string)")
    chat_template_kwargs: Annotated[dict[str, Any], AfterValidator(all_text)] | None = field(
        "an object of the template's variables")
    add_generation_prompt: bool | None = field("a boolean")
    continue_final_message: bool | None = field("a boolean")
    echo: bool | None = field("false (vLLM's chat echo is not supported)")

    _prompt_part = "chat"
    _logprobs_field = "top_logprobs"

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template reads them."""
        return [message.template_message() for message in self.messages]

    def _chat(self) -> ChatFields:
        return chat_fields(self.chat_template, self.chat_template_kwargs,
                           self.add_generation_prompt, self.continue_final_message)

    def _endpoint_options(self) -> tuple[tuple[Mapping[str, Any], ...], str, int | None, bool]:
        tools = tuple(tool.sent for tool in self.tools or ())
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if name not in {tool["function"]["name"] for tool in tools}:
                raise RequestError(f"'tool_choice' names the function {name!r}, which is not "
                                   "among 'tools'", param="tool_choice")
            tool_choice = name
        else:
            tool_choice = choice or ("auto" if tools else "none")
            if tool_choice != "none" and not tools:
                raise RequestError(f"'tool_choice' {tool_choice!r} needs 'tools'",
                                   param="tool_choice")
        if self.echo:
            raise RequestError("'echo' on chat (vLLM's: the answer prefixed with the last "
                               "message) is not supported by this server; leave it out or send "
                               "false", param="echo", code="unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return tools, tool_choice, logprobs, False


def chat_fields(template: str | None, variables: Mapping[str, Any] | None,
                add_generation_prompt: bool | None, continue_final_message: bool | None
                ) -> ChatFields:
    """A chat's rendering fields, checked: no variable the renderer sets itself, no
    continuation with an explicit generation prompt (the generation prompt is off by default
    when the final message is continued)."""
    reserved = sorted(RESERVED_VARIABLES & set(variables or ()))
    if reserved:
        name = reserved[0]
        where = (f"send '{name}' as a field of its own" if name in (
            "add_generation_prompt", "continue_final_message", "chat_template", "tools")
            else "the renderer sets it itself")
        raise RequestError(f"'chat_template_kwargs.{name}' is not a variable a request may "
                           f"set: {where}", param=f"chat_template_kwargs.{name}")
    keep = bool(continue_final_message)
    if keep and add_generation_prompt:
        raise RequestError("'continue_final_message' and 'add_generation_prompt' both set "
                           "true: one continues the final message, the other starts a new "
                           "one; send one of them", param="continue_final_message")
    add = (not keep) if add_generation_prompt is None else add_generation_prompt
    return ChatFields(template=template, variables=dict(variables or {}),
                      add_generation_prompt=add, continue_final_message=keep)


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    path = COMPLETIONS_PATH

    prompt: NonEmptyText | TokenIds | Annotated[
        list[NonEmptyText | TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)] = Field(
        description="a non-empty string or a list of token ids (integers >= 0), or a list of "
                    f"up to {MAX_PROMPTS} of those")
    echo: bool | None = field("a boolean")
    logprobs: int | None = field(f"an integer in [0, {MAX_TOP_LOGPROBS}]", ge=0,
                                  le=MAX_TOP_LOGPROBS)

    def prompts(self) -> tuple[str | tuple[int, ...], ...]:
        """Every prompt: a text, or token ids."""
        if isinstance(self.prompt, str):
            return (self.prompt,)
        items: list[Any] = list(self.prompt)
        if all(isinstance(item, int) for item in items):
            return (tuple(items),)
        return tuple(item if isinstance(item, str) else tuple(item) for item in items)

    def _endpoint_options(self) -> tuple[tuple[Mapping[str, Any], ...], str, int | None, bool]:
        return (), "none", self.logprobs, bool(self.echo)

    def _resolve(self, vocab_size: int | None) -> RequestOptions:
        prompts = self.prompts()
        for number, prompt in enumerate(prompts):
            if isinstance(prompt, str) or vocab_size is None:
                continue
            outside = next(((position, token) for position, token in enumerate(prompt)
                            if token >= vocab_size), None)
            if outside is not None:
                position, token = outside
                which = f"prompt {number}'s" if len(prompts) > 1 else "its"
                raise RequestError(f"'prompt' holds token ids (integers >= 0 below {vocab_size}"
                                   f", the vocabulary's size); {which} id at position "
                                   f"{position} is {shown(token)}", param="prompt")
        return super()._resolve(vocab_size)


ChatCompletionRequest.other = CompletionRequest
CompletionRequest.other = ChatCompletionRequest


# Every field a generation request may hold (anything else: 400 `unknown_parameter`).
KNOWN_FIELDS = (frozenset(ChatCompletionRequest.model_fields)
                | frozenset(CompletionRequest.model_fields) | frozenset(REFUSED))
