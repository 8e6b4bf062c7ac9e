"""A generation request's options once its body is checked (`RequestOptions`), and its
`Sampling`.

The request models (requests.py, one per endpoint) check the body and resolve it into
`RequestOptions`; this module holds what they resolve into, the fields refused (`REFUSED`: a
400 naming the field unless it holds its default; docs/serving.md says why for each), and the
`Sampling` a request runs with: genai_config.json's search defaults, overridden by each field
the request sets, its grammar (response_format, a forced tool call) compiled, its bad words
encoded as vLLM encodes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onnx_chunk.errors import InputError
from onnx_chunk.sampling import Sampling
from onnx_chunk.serve.protocol import RequestError
from onnx_chunk.serve.tools import call_schema

if TYPE_CHECKING:
    from onnx_chunk.text.tokenizer import Tokenizer

# Fields refused unless they hold their default (the values listed).
REFUSED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none"),
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
    "reasoning_effort": (None,),
    "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
    "web_search_options": (None,), "documents": (None, []),
    "grammar": (None, ""), "guided_whitespace_pattern": (None,),
    "logits_processors": (None, []), "priority": (None, 0), "guided_decoding_backend": (None,),
    "mirostat": (None, 0), "tfs_z": (None, 1, 1.0), "dry_multiplier": (None, 0, 0.0),
    "xtc_probability": (None, 0, 0.0), "penalty_last_n": (None,), "samplers": (None,),
    "n_probs": (None, 0),
}
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
    # The request field that set it: response_format, or llama.cpp's json_schema.
    param: str = "response_format"


@dataclass(frozen=True)
class ChatFields:
    """How a chat request's messages are rendered (vLLM's chat fields): its own template
    source (None: the model's), the template variables, the generation prompt or the final
    message continued."""

    template: str | None = None
    variables: Mapping[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass(frozen=True)
class RequestOptions:
    """What a generation request asks for beyond its prompt, checked and resolved (aliases
    merged, defaults applied)."""

    # The new tokens at most (None: the room left in the context).
    max_tokens: int | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    # vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far.
    continuous_usage: bool = False
    # vLLM's: the answer's id is the endpoint's prefix and this (None: a random one).
    request_id: str | None = None
    model: str | None = None
    stop: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: only these ids may be chosen (None: all); words whose token sequences are banned.
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
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
    # vLLM's: each prompt token's logprobs, with this many most likely tokens (None: none).
    prompt_logprobs: int | None = None
    # vLLM's: logprobs name their tokens "token_id:N".
    return_tokens_as_token_ids: bool = False
    # vLLM's detokenization fields.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: only the last this many prompt ids are fed (-1: as many as the context leaves).
    truncate_prompt_tokens: int | None = None
    chat: ChatFields = field(default_factory=ChatFields)
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

    @property
    def template_tools(self) -> tuple[Mapping[str, Any], ...]:
        """The tools the chat template shows the model (none with tool_choice "none")."""
        return () if self.tool_choice == "none" else self.tools

    def sampling(self, *, search: Mapping[str, Any], tokenizer: Tokenizer, vocab_size: int,
                 ends: tuple[int, ...], cache_salt: str | None = None) -> Sampling:
        """The request's `Sampling`: genai_config.json's `search` defaults, overridden by what
        the request sets; its grammar (response_format, a forced tool call) compiled here
        (a schema the library refuses: RequestError naming its field); `ends`: its end ids;
        `cache_salt`: the prefix namespace the server chose for it."""
        schema = None
        if self.response_format is not None:
            schema = self.response_format.schema
        elif self.tool_choice not in ("none", "auto"):
            schema = call_schema(self.tools, self.tool_choice)
        constraint = None
        if schema is not None:
            from onnx_chunk.structured import json_constraint

            try:
                constraint = json_constraint(tokenizer, schema, vocab_size)
            except InputError as error:
                raise RequestError(str(error), param=self.response_format.param
                                   if self.response_format else "tools") from error
        held = ends if self.min_tokens and ends else ()
        banned = bad_words_ids(self.bad_words, tokenizer, vocab_size)
        if self.allowed_token_ids is not None:
            barred = {*held, *(word[0] for word in banned if len(word) == 1)}
            if barred.issuperset(self.allowed_token_ids):
                raise RequestError("'allowed_token_ids' leaves no token to choose: every id it "
                                   "allows is banned by 'bad_words' or held back by "
                                   "'min_tokens'", param="allowed_token_ids")
        echoed = self.logprobs if self.echo else None
        prompt_top = max((count for count in (echoed, self.prompt_logprobs)
                          if count is not None), default=None)
        return Sampling.from_search(
            search, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
            top_k=self.top_k, min_p=self.min_p, typical_p=self.typical_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
            bad_words_ids=banned,
            min_tokens=self.min_tokens if held else 0,
            held_token_ids=held, constraint=constraint, logprobs=self.logprobs,
            prompt_logprobs=prompt_top, cache_salt=cache_salt)


def bad_words_ids(words: tuple[str, ...], tokenizer: Tokenizer,
                  vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """The token sequences of `bad_words`, as vLLM's `SamplingParams.update_from_tokenizer`
    makes them (vllm/sampling_params.py): each word without its leading spaces, encoded
    without special tokens, and again after one space when that gives a sequence of the same
    length starting with another id (the word in the middle of a text); RequestError naming
    `bad_words` for a word of no token or an id past the model's vocabulary."""
    found: list[tuple[int, ...]] = []
    for word in dict.fromkeys(words):
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise RequestError(f"'bad_words' holds {word[:40]!r}, which encodes to no token",
                               param="bad_words")
        found.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            found.append(spaced)
    outside = [token for sequence in found for token in sequence if token >= vocab_size]
    if outside:
        raise RequestError(f"'bad_words' encode to token id {outside[0]}, outside the model's "
                           f"vocabulary of {vocab_size}", param="bad_words")
    return tuple(dict.fromkeys(found))


def unknown_field(name: str, elsewhere: str | None = None) -> RequestError:
    """The refusal of a field the endpoint does not know (`elsewhere`: the endpoint that
    does)."""
    if elsewhere is not None:
        return RequestError(f"'{name}' belongs to {elsewhere}; send the request there",
                            param=name, code="unknown_parameter")
    return RequestError(f"unrecognized request field {name[:60]!r}: this server does not "
                        "know it, and would not honour it; leave it out (docs/serving.md "
                        "lists the fields)", param=name[:200], code="unknown_parameter")


def refuse_unbuilt(body: Mapping[str, Any]) -> None:
    """RequestError naming the first field of `REFUSED` that holds anything but its default."""
    for name, defaults in REFUSED.items():
        value = body.get(name)
        if not any(value == default and type(value) is type(default) for default in defaults):
            raise RequestError(f"'{name}' is not supported by this server; leave it out",
                               param=name, code="unsupported_parameter")
