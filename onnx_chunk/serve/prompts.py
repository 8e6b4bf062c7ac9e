"""A generation request's prompts as the ids the engine is fed, every refusal named.

Chat: the messages through the model's chat template or the request's own (`chat_template`,
compiled in the same sandbox; only on a server started with `--trust-request-chat-template`,
as vLLM's, else 400 naming it: a template is code, and the sandbox bounds what it reaches, not
the time or memory it spends), with its `chat_template_kwargs`, and the generation prompt or
the final message continued (vLLM's fields); completions: each prompt encoded (or its ids as
given). `truncate_prompt_tokens` keeps the last N ids (-1: as many as the context leaves after
the output's length; vLLM's rule, vllm/renderers/params.py: at most that many). The encoder is
the server's one `PromptEncoder`.

A template's failure is answered by who caused it: the request's own template (400,
`param: chat_template`), its variables (400, `chat_template_kwargs`: the model's template
renders the same messages without them), the sandbox's refusal of what a template reaches for
or its `raise_exception` (400, `chat_template` or `messages`); the model's template failing
on its own stays the server's fault (ChatTemplateFault: 500).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from onnx_chunk.errors import CapacityError, InputError
from onnx_chunk.serve.protocol import RequestError
from onnx_chunk.serve.requests import ChatCompletionRequest, CompletionRequest
from onnx_chunk.serve.tools import check_auto
from onnx_chunk.text.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateFault,
    ChatTemplateSandboxError,
    ContinuationError,
)
from onnx_chunk.text.prompt import ChatOptions

if TYPE_CHECKING:
    from onnx_chunk.serve.parameters import ChatFields, RequestOptions
    from onnx_chunk.text.prompt import PromptEncoder

# Where a request's own chat template is said to come from.
REQUEST_TEMPLATE = "the request's chat_template"


def chat_options(fields: ChatFields, prompts: PromptEncoder) -> ChatOptions:
    """How a request's messages render: its template compiled (400 naming `chat_template`
    when the server does not take request templates or it does not compile), its variables,
    the generation prompt or the continuation."""
    template = None
    if fields.template is not None:
        if not prompts.request_templates:
            raise RequestError("'chat_template' is a template of the request's making, and this "
                               "server renders with its model's own; leave it out (a server "
                               "started with --trust-request-chat-template takes it, as vLLM's "
                               "does)", param="chat_template", code="untrusted_chat_template")
        try:
            template = prompts.tokenizer.compile_template(fields.template, REQUEST_TEMPLATE)
        except InputError as error:
            raise RequestError(str(error), param="chat_template",
                               code="invalid_chat_template") from error
    return ChatOptions(add_generation_prompt=fields.add_generation_prompt,
                       continue_final_message=fields.continue_final_message,
                       variables=fields.variables, template=template)


def kept(request: ChatCompletionRequest | CompletionRequest, capacity: int) -> int | None:
    """The prompt ids the request keeps (None: all): `truncate_prompt_tokens`, -1 for the
    context less the output's length (at least `min_tokens`); refused past that (vLLM's
    rule)."""
    options = request.options
    asked = options.truncate_prompt_tokens
    if asked is None:
        return None
    output = max(options.max_tokens or 1, options.min_tokens)
    room = capacity - output
    if asked > room:
        raise RequestError(f"'truncate_prompt_tokens' is {asked}, more than the context of "
                           f"{capacity} less the output's {output} tokens "
                           f"({room}); ask for a smaller truncation",
                           param="truncate_prompt_tokens")
    return room if asked == -1 else asked


def chat_ids(request: ChatCompletionRequest, prompts: PromptEncoder, capacity: int
             ) -> list[int]:
    """The ids a chat request is fed (see the module docstring)."""
    options = request.options
    chat = chat_options(options.chat, prompts)
    if options.tool_choice == "auto":
        template = chat.template or prompts.tokenizer.chat_template
        check_auto(None if template is None else template.source)
    keep = kept(request, capacity)
    ids = rendered_ids(request.template_messages(), options.template_tools, chat, prompts, keep)
    if not ids and keep != 0:
        raise RequestError("the chat template renders these messages into no token; the model "
                           "needs at least one to answer", param=_blamed(chat.template))
    return ids


def rendered_ids(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]],
                 chat: ChatOptions, prompts: PromptEncoder, keep: int | None) -> list[int]:
    """The ids of `messages` rendered under `chat`, a template's failure answered by who
    caused it (see the module docstring)."""
    try:
        return prompts.encode(messages, tools=tools, chat=chat, keep_last=keep)
    except ContinuationError as error:
        raise RequestError(str(error), param="continue_final_message") from error
    except ChatTemplateFault as error:
        if chat.template is not None:
            raise _refusal(error, "chat_template", "chat_template_failed") from error
        if chat.variables and _renders_without_variables(messages, tools, prompts, chat):
            raise RequestError(f"the model's chat template renders these messages, but not "
                               f"with these 'chat_template_kwargs' ({error.__cause__!r}); "
                               "change them", param="chat_template_kwargs",
                               code="chat_template_failed") from error
        raise
    except ChatTemplateSandboxError as error:
        raise _refusal(error, _blamed(chat.template), "chat_template_sandbox") from error
    except ChatTemplateError as error:
        raise _refusal(error, _blamed(chat.template), None) from error


def completion_ids(request: CompletionRequest, prompts: PromptEncoder, capacity: int
                   ) -> list[list[int]]:
    """The ids of each prompt of a completions request (token-id prompts as given, then
    truncated alike)."""
    keep = kept(request, capacity)
    encoded = []
    for prompt in request.prompts():
        if isinstance(prompt, str):
            encoded.append(prompts.encode(prompt, keep_last=keep))
        else:
            ids = list(prompt)
            encoded.append(ids if keep is None else ids[len(ids) - keep:])
    return encoded


def _blamed(template: ChatTemplate | None) -> str:
    return "messages" if template is None else "chat_template"


def _refusal(error: ChatTemplateError, param: str, code: str | None) -> RequestError:
    return RequestError(str(error), param=param, code=code)


def _renders_without_variables(messages: list[dict[str, Any]],
                               tools: Sequence[Mapping[str, Any]], prompts: PromptEncoder,
                               chat: ChatOptions) -> bool:
    """Whether the model's template renders the messages once the variables are left out."""
    plain = ChatOptions(add_generation_prompt=chat.add_generation_prompt,
                        continue_final_message=chat.continue_final_message)
    try:
        prompts.render(messages, tools=tools, chat=plain)
    except (ChatTemplateError, InputError, CapacityError):
        return False
    return True


def check_room(prompt_tokens: int, capacity: int, options: RequestOptions) -> None:
    """Before any work: CapacityError where a prompt of `prompt_tokens` ids leaves no room
    for a new token and the request sets no length (the room left is then its length);
    RequestError naming `min_tokens` where that room is fewer tokens than it asks for (vLLM
    sets the length to the room left and refuses `min_tokens` past it)."""
    if options.max_tokens is not None:
        return
    room = capacity - prompt_tokens
    if room < 1:
        raise CapacityError(f"the prompt has {prompt_tokens} tokens and the context holds "
                            f"{capacity}, leaving no room for a new token; shorten the prompt")
    if options.min_tokens > room:
        raise RequestError(f"'min_tokens' must be at most the output's length, the "
                           f"{room} tokens the context leaves after the prompt, got "
                           f"{options.min_tokens}", param="min_tokens")
