"""vLLM's /tokenize and /detokenize: the server's tokenizer and chat template over HTTP.

/tokenize takes {"prompt": str, "add_special_tokens": true} or {"messages": [...],
"add_generation_prompt": true, "tools": [...]} (with vLLM's "continue_final_message",
"chat_template" and "chat_template_kwargs"), each with an optional "return_token_strs"
(requests.py's `TokenizeRequest`), and answers {"count", "max_model_len", "tokens",
"token_strs"}: the ids a generation request with the same prompt is fed, by the server's own
`PromptEncoder` (its special-token policy; the messages, tools and template checked as chat
checks them). A prompt over the context is refused (400) before it is encoded, as a generation
request's is. /detokenize takes {"tokens": [ids]} (`DetokenizeRequest`) and answers
{"prompt": text}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, Field, ValidationInfo, model_validator

from onnx_chunk.errors import CapacityError
from onnx_chunk.serve.body import RequestModel, vocab_size_of
from onnx_chunk.serve.messages import (
    TOOL_FORM,
    ChatMessage,
    NonEmptyText,
    Text,
    TokenId,
    Tool,
    all_text,
    field,
)
from onnx_chunk.serve.parameters import ChatFields
from onnx_chunk.serve.prompts import chat_options, rendered_ids
from onnx_chunk.serve.protocol import RequestError, shown
from onnx_chunk.serve.requests import chat_fields

if TYPE_CHECKING:
    from onnx_chunk.text.prompt import PromptEncoder
    from onnx_chunk.text.tokenizer import Tokenizer


class TokenizeRequest(RequestModel):
    """POST /tokenize (vLLM's): a prompt, or messages through the chat template."""

    model: str | None = field("a string: the id of this server's model")
    prompt: Text | None = field("a string (or send 'messages')")
    messages: list[ChatMessage] | None = field("a non-empty list of messages", min_length=1)
    add_special_tokens: bool = Field(True, description="a boolean")
    add_generation_prompt: bool | None = field("a boolean")
    continue_final_message: bool | None = field("a boolean")
    chat_template: NonEmptyText | None = field("a Jinja chat template (a non-empty string)")
    chat_template_kwargs: Annotated[dict[str, Any], AfterValidator(all_text)] | None = field(
        "an object of the template's variables")
    tools: list[Tool] | None = field(f"a list of {TOOL_FORM} (function tools only)")
    return_token_strs: bool = Field(False, description="a boolean")

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if "messages" in self.model_fields_set:
            if self.messages is None:
                raise RequestError("'messages' must be a non-empty list of messages, got None "
                                   "(null)", param="messages")
            if "add_special_tokens" in self.model_fields_set and self.add_special_tokens:
                raise RequestError("'add_special_tokens' cannot be true with 'messages': the "
                                   "chat template writes the special tokens",
                                   param="add_special_tokens")
            _ = self.chat
        elif self.prompt is None:
            raise RequestError("'prompt' must be a string (or send 'messages'), got None "
                               "(null)", param="prompt")
        return self

    def template_messages(self) -> list[dict[str, Any]] | None:
        """The messages as the chat template reads them (None: a text prompt)."""
        if self.messages is None:
            return None
        return [message.template_message() for message in self.messages]

    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.sent for tool in self.tools or ()]

    @property
    def chat(self) -> ChatFields:
        """How the messages render (as a chat request's)."""
        return chat_fields(self.chat_template, self.chat_template_kwargs,
                           self.add_generation_prompt, self.continue_final_message)


class DetokenizeRequest(RequestModel):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = field("a string: the id of this server's model")
    tokens: list[TokenId] = Field(description="a list of token ids")

    @model_validator(mode="after")
    def _in_vocabulary(self, info: ValidationInfo) -> DetokenizeRequest:
        vocab_size = vocab_size_of(info)
        if vocab_size is not None and any(token >= vocab_size for token in self.tokens):
            raise RequestError(f"'tokens' must be a list of token ids in [0, {vocab_size}), "
                               f"got {shown(self.tokens)}", param="tokens")
        return self


def tokenize(body: object, prompts: PromptEncoder,
             check_model: Callable[[object], None]) -> dict[str, Any]:
    """The answer of /tokenize (see the module docstring); `prompts`: the server's encoder,
    bounded by its context."""
    request = TokenizeRequest.parse(body)
    check_model(request.model)
    messages = request.template_messages()
    try:
        if messages is not None:
            ids = rendered_ids(messages, request.template_tools(),
                               chat_options(request.chat, prompts), prompts, None)
        else:
            assert request.prompt is not None  # the model requires one of them
            ids = prompts.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    except CapacityError as error:
        raise RequestError(str(error), param="prompt" if messages is None else "messages",
                           code="context_length_exceeded") from error
    tokenizer = prompts.tokenizer
    strings = ([tokenizer.id_to_token(token) for token in ids]
               if request.return_token_strs else None)
    return {"count": len(ids), "max_model_len": prompts.max_tokens, "tokens": ids,
            "token_strs": strings}


def detokenize(body: object, tokenizer: Tokenizer,
               check_model: Callable[[object], None]) -> dict[str, Any]:
    """The answer of /detokenize: {"prompt": the text of "tokens"}."""
    request = DetokenizeRequest.parse(body, vocab_size=tokenizer.vocab_size)
    check_model(request.model)
    return {"prompt": tokenizer.decode(request.tokens)}
