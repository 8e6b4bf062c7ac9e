"""The one prompt encoder: a prompt (text, or messages with optional tools) to token ids.

Every entry point that feeds a prompt to the model turns it into ids here: `generate_text`,
`stream_text` and `generate --prompt`, a `Conversation`'s turns, the server's chat and
completion endpoints, `/tokenize`, and the Ray ingress's routing key (which renders what the
replica renders, without encoding it). A `PromptEncoder` holds the policy:

- text is encoded with the tokenizer's special tokens (BOS where its post-processor adds one),
  the special tokens spelled in it parsed as control tokens, as transformers' `encode` does;
- messages are rendered through the chat template (with `tools` as transformers passes them
  and the generation prompt) and encoded without adding special tokens, as transformers'
  `apply_chat_template(tokenize=True)` does;
- `special_in_content`: the special tokens typed in the messages' role and content become
  control tokens (transformers' behaviour, the Python API's); False keeps them as text, as
  OpenAI's API treats content (a user cannot forge a turn): the typed strings are swapped for
  placeholders before rendering, and each placeholder left in the rendering is encoded as the
  plain text of what it stands for;
- `request_templates`: a caller may render under a template of its own (`ChatOptions.template`;
  the Python API's caller is trusted); False (a server's default, as vLLM's without
  `--trust-request-chat-template`) leaves that to the server to refuse (`serve/prompts.py`);
- `max_tokens`: a prompt too long to be that many tokens is refused (CapacityError) before it
  is encoded (text: by its length; messages: as the template renders);
- `keep_last` (vLLM's `truncate_prompt_tokens`): only the last that many ids are fed; the
  text is then not refused for its length (its caller bounds it), and a rendering may run
  past the context's characters by twice the messages' own.
A conversation renders under `ChatOptions`: the generation prompt or the final message
continued, the caller's template variables, a caller's own template (vLLM's chat fields).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onnx_chunk.errors import CapacityError
from onnx_chunk.text.chat_template import RenderTooLong

if TYPE_CHECKING:
    from onnx_chunk.text.chat_template import ChatTemplate
    from onnx_chunk.text.tokenizer import Tokenizer

# Text, or a conversation: [{"role": ..., "content": ...}, ...].
Prompt = str | Sequence[Mapping[str, Any]]
Tools = Sequence[Mapping[str, Any]]

# The message fields whose typed special tokens are kept as text.
_TYPED_FIELDS = ("role", "content")


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered (vLLM's chat request fields): with the generation prompt,
    or ending right after the final message's content so the model continues it; with the
    caller's template `variables` (chat_template_kwargs); through `template`, a caller's own
    (None: the model's)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: Mapping[str, Any] = field(default_factory=dict)
    template: ChatTemplate | None = None


@dataclass(frozen=True)
class RenderedChat:
    """Messages through the chat template: the text (typed special tokens as typed) and the
    ids it is fed as."""

    text: str
    ids: list[int]


@dataclass(frozen=True)
class _Rendering:
    """A rendering whose typed special tokens are placeholders `\\ue000NONCE<i>\\ue001`."""

    text: str
    typed: list[str]
    nonce: str

    def pieces(self) -> list[str]:
        """The rendering split at its placeholders: text at even places, a placeholder's
        index at odd ones."""
        if not self.typed:
            return [self.text]
        return re.split(f"\ue000{self.nonce}(\\d+)\ue001", self.text)

    def restored(self) -> str:
        """The rendering with each placeholder back to what was typed."""
        return "".join(self.typed[int(piece)] if index % 2 else piece
                       for index, piece in enumerate(self.pieces()))


class PromptEncoder:
    """Prompts to ids for one tokenizer under one special-token policy (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, *, special_in_content: bool = True,
                 max_tokens: int | None = None, request_templates: bool = True) -> None:
        self.tokenizer = tokenizer
        self.special_in_content = special_in_content
        self.request_templates = request_templates
        self.max_tokens = max_tokens

    def encode(self, prompt: Prompt, *, tools: Tools | None = None,
               add_generation_prompt: bool = True, add_special_tokens: bool = True,
               chat: ChatOptions | None = None, keep_last: int | None = None) -> list[int]:
        """The ids `prompt` is fed as; `add_special_tokens` (text only: for messages the
        template writes the special tokens) adds what the tokenizer's post-processor adds;
        `chat` renders messages (default: with the generation prompt as
        `add_generation_prompt` says); `keep_last`: only the last that many ids."""
        if isinstance(prompt, str):
            if self.max_tokens is not None and keep_last is None:
                self.tokenizer.check_fits(prompt, self.max_tokens)
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = self.render(prompt, tools=tools, chat=chat or ChatOptions(
                add_generation_prompt=add_generation_prompt), keep_last=keep_last).ids
        return ids if keep_last is None else ids[len(ids) - keep_last:] if keep_last else []

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Tools | None = None,
               add_generation_prompt: bool = True, chat: ChatOptions | None = None,
               keep_last: int | None = None) -> RenderedChat:
        """The rendering of `messages` and its ids (for a caller that matches the text of one
        turn against the next); `keep_last`: the rendering is bounded for a prompt whose last
        that many ids are kept (the ids are whole)."""
        span = self.tokenizer.max_token_chars
        bound = None if self.max_tokens is None or span is None else self.max_tokens * span
        if bound is not None and keep_last is not None:
            bound += 2 * sum(len(message.get("content") or "") for message in messages
                             if isinstance(message.get("content") or "", str))
        try:
            rendering = self._render(messages, tools, chat or ChatOptions(
                add_generation_prompt=add_generation_prompt), bound)
        except RenderTooLong as error:
            raise CapacityError(
                f"the chat template renders these messages into more than {error.max_chars} "
                f"characters, more than {self.max_tokens} tokens can hold (a token of this "
                f"tokenizer stands for at most {span} characters; the KV capacity is "
                f"{self.max_tokens}); shorten the conversation") from error
        tokenizer = self.tokenizer
        ids: list[int] = []
        pieces = rendering.pieces()
        for index, piece in enumerate(pieces):
            if index % 2:
                ids += tokenizer.encode(rendering.typed[int(piece)], add_special_tokens=False,
                                        special_as_text=True)
            elif piece:
                ids += tokenizer.encode(piece, add_special_tokens=False)
        return RenderedChat(rendering.restored(), ids)

    def render_text(self, messages: Sequence[Mapping[str, Any]], *, tools: Tools | None = None,
                    max_chars: int | None = None, chat: ChatOptions | None = None) -> str:
        """The text `encode` feeds for `messages` (by default with the generation prompt),
        not encoded: the router's key; RenderTooLong past `max_chars` characters."""
        return self._render(messages, tools, chat or ChatOptions(), max_chars).restored()

    def _render(self, messages: Sequence[Mapping[str, Any]], tools: Tools | None,
                chat: ChatOptions, max_chars: int | None) -> _Rendering:
        rendered: list[dict[str, Any]] = [dict(message) for message in messages]
        typed: list[str] = []
        nonce = uuid.uuid4().hex
        pattern = None if self.special_in_content else self.tokenizer.special_pattern
        if pattern is not None:
            def placeholder(match: re.Match) -> str:
                typed.append(match.group())
                return f"\ue000{nonce}{len(typed) - 1}\ue001"

            for message in rendered:
                for name in _TYPED_FIELDS:
                    if isinstance(message.get(name), str):
                        message[name] = pattern.sub(placeholder, message[name])
        text = self.tokenizer.apply_chat_template(
            rendered, add_generation_prompt=chat.add_generation_prompt, max_chars=max_chars,
            tools=tools or None, template=chat.template, variables=chat.variables,
            continue_final_message=chat.continue_final_message)
        return _Rendering(text, typed, nonce)
