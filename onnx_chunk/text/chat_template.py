"""A model's chat template, found and rendered as transformers' `apply_chat_template` does.

Where it is: `chat_template.jinja` in the model folder, else `tokenizer_config.json`'s
`chat_template` (a string, or a list of {"name", "template"} of which "default" is used).
How it renders: jinja2's ImmutableSandboxedEnvironment (its `*`, `**` and `+` bounded: a string,
list or tuple they would make of more than MAX_TEMPLATE_ITEMS items, or an integer of more than
MAX_TEMPLATE_INT_BITS bits, is refused before it is made) with trim_blocks, lstrip_blocks, the
loopcontrols extension and the `{% generation %}` block (rendered as its body: transformers uses
it only to track assistant tokens); `raise_exception(message)` raises; `tojson` is json.dumps
with ensure_ascii=False (indent, separators, sort_keys passed through) in place of jinja's
HTML-escaping filter; `strftime_now(format)` is the local time; the variables are `messages`,
`tools` (the caller's list of tool schemas, or None) and `documents` (None),
`add_generation_prompt`, every declared special token (bos_token, eos_token, unk_token,
sep_token, pad_token, cls_token, mask_token) by name, as transformers 5 passes them (no
additional_special_tokens), and the caller's `variables` (vLLM's `chat_template_kwargs`; they
may override a special token, never a name of `RESERVED_VARIABLES`). `continue_final_message`
cuts the rendering right after the final message's content, as transformers'
`apply_chat_template` does (src/transformers/utils/chat_template_utils.py), so the model
continues that message.

What a render raises: the template's `raise_exception` refuses the messages
(ChatTemplateError, an input error); the sandbox's refusal of what a template reaches for (an
attribute such as `__subclasses__`, a mutation such as `messages.append`) is
ChatTemplateSandboxError, an input error too; any other failure while rendering (a TypeError,
an OverflowError, an undefined name...) is the template's fault, not the messages'
(ChatTemplateFault); a rendering longer than `max_chars` stops there (RenderTooLong), so a
template that loops cannot build an unbounded prompt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from onnx_chunk.errors import CapacityError, InputError, ModelLoadError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_TEMPLATE_NAME = "default"
# The most items a string, list or tuple made by the template's `*` or `+` may hold (16 Mi: twice
# a message filling the server's default 8 MiB body), and the most bits of an integer its
# `**` or `*` may make: past them the sandbox refuses (no real template comes near).
MAX_TEMPLATE_ITEMS = 1 << 24
MAX_TEMPLATE_INT_BITS = 4096
# Names a caller's variables may not take: the renderer's own arguments and the template's
# globals (jinja's and transformers'), which a variable would shadow.
RESERVED_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "raise_exception", "strftime_now", "range", "dict", "lipsum",
    "cycler", "joiner", "namespace"})


class ChatTemplateError(InputError):
    """The chat template refused the messages (its raise_exception), or failed rendering them."""


class ChatTemplateSandboxError(ChatTemplateError):
    """The template reached for something the sandbox forbids (a private attribute, a
    mutation): refused, as a template of the caller's making."""


class ContinuationError(InputError):
    """`continue_final_message` cannot continue the final message (it has no text, or the
    template does not write it as sent)."""


class ChatTemplateFault(ChatTemplateError):
    """The chat template failed while rendering (a TypeError, an OverflowError, ...): a fault of
    the model's template, not of the messages (a server answers it as its own fault)."""


class RenderTooLong(CapacityError):
    """A rendering passed the `max_chars` it was given (it stopped there)."""

    def __init__(self, message: str, max_chars: int) -> None:
        super().__init__(message)
        self.max_chars = max_chars


class _Refused(Exception):
    """What the template's raise_exception raises."""


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any], origin: str) -> None:
        import jinja2

        self.source = source
        self.origin = origin
        self._special_tokens = dict(special_tokens)
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ModelLoadError(f"the chat template in {origin} does not compile (line "
                                 f"{error.lineno}: {error.message}); fix the template") from error

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = False, max_chars: int | None = None,
               tools: Sequence[Mapping[str, Any]] | None = None,
               variables: Mapping[str, Any] | None = None,
               continue_final_message: bool = False) -> str:
        """The prompt text of `messages` ([{"role", "content"}, ...]); `tools` as transformers
        passes them (OpenAI's {"type": "function", "function": {...}} objects); `variables`:
        more names the template sees; `continue_final_message`: end right after the final
        message's content (not with the generation prompt); RenderTooLong as soon as it passes
        `max_chars` characters (None: no bound)."""
        import jinja2.exceptions

        _check_messages(messages)
        reserved = sorted(RESERVED_VARIABLES & set(variables or ()))
        if reserved:
            raise InputError(f"the template variable {reserved[0]!r} is set by the renderer "
                             "itself; leave it out of the variables")
        if continue_final_message and add_generation_prompt:
            raise InputError("continue_final_message and add_generation_prompt do not go "
                             "together: one continues the final message, the other starts a "
                             "new one")
        pieces: list[str] = []
        length = 0
        try:
            for piece in self._template.generate(
                    messages=[dict(message) for message in messages],
                    tools=None if not tools else [dict(tool) for tool in tools], documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **{**self._special_tokens, **(variables or {})}):
                length += len(piece)
                if max_chars is not None and length > max_chars:
                    raise RenderTooLong(f"the chat template's rendering passed {max_chars} "
                                        "characters", max_chars)
                pieces.append(piece)
        except _Refused as error:
            raise ChatTemplateError(f"the chat template of {self.origin} refused the messages: "
                                    f"{error}") from error
        except jinja2.exceptions.SecurityError as error:
            raise ChatTemplateSandboxError(
                f"the chat template of {self.origin} reached for what its sandbox forbids "
                f"(SecurityError: {error}); a chat template may read the messages, not change "
                "them or the interpreter's internals") from error
        except (RenderTooLong, MemoryError):
            raise
        except Exception as error:  # anything else is the template's own failure
            raise ChatTemplateFault(
                f"the chat template of {self.origin} failed rendering the messages "
                f"({type(error).__name__}: {error}); the template is at fault, not the "
                "messages: fix the chat template") from error
        text = "".join(pieces)
        return _continued(text, messages[-1]) if continue_final_message else text


def _continued(text: str, final: Mapping[str, Any]) -> str:
    """`text` cut right after the final message's content (transformers' rule: its last
    occurrence, the content's trailing whitespace kept where the template kept it)."""
    content = final.get("content")
    if not isinstance(content, str) or not content.strip():
        raise ContinuationError("continue_final_message needs a final message with text to "
                                "continue")
    found = text.rfind(content.strip())
    if found < 0:
        raise ContinuationError("continue_final_message is set but the chat template does not "
                                "write the final message's content as sent; the model cannot "
                                "continue it")
    if text[found:found + len(content.lstrip())] == content:
        return text[:found + len(content.lstrip())]
    return text[:found + len(content.strip())]


def find_chat_template(folder: Path, config: Mapping[str, Any]) -> tuple[str, str] | None:
    """The template source and where it came from, as transformers picks it (None: none)."""
    path = folder / CHAT_TEMPLATE_FILE
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8"), repr(str(path))
        except (OSError, UnicodeDecodeError) as error:
            raise ModelLoadError(f"cannot read the chat template {str(path)!r} ({error}); fix "
                                 "or remove the file") from error
    value = config.get("chat_template")
    origin = f"{str(folder / 'tokenizer_config.json')!r}"
    if value is None:
        return None
    if isinstance(value, str):
        return value, origin
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value
                 if isinstance(entry, dict)}
        template = named.get(DEFAULT_TEMPLATE_NAME)
        if isinstance(template, str):
            return template, f"{origin} (template {DEFAULT_TEMPLATE_NAME!r})"
        raise ModelLoadError(
            f"{origin} holds named chat templates ({', '.join(map(repr, named))}) but none named "
            f"{DEFAULT_TEMPLATE_NAME!r}; name the one to use {DEFAULT_TEMPLATE_NAME!r}")
    raise ModelLoadError(f"{origin}: chat_template must be a string or a list of named "
                         f"templates, got {type(value).__name__}; fix the tokenizer config")


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise _Refused(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [],
                                          body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, its `*`, `**` and `+` refusing what would be too large to make."""

        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context, operator, left, right):
            _check_size(operator, left, right)
            return super().call_binop(context, operator, left, right)

    environment = BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment


def _check_size(operator: str, left: Any, right: Any) -> None:
    """SecurityError when `left operator right` would hold more than MAX_TEMPLATE_ITEMS items
    or MAX_TEMPLATE_INT_BITS bits (see the module docstring)."""
    from jinja2.exceptions import SecurityError

    sized = (str, list, tuple)
    if operator == "*":
        sequence, count = (left, right) if isinstance(left, sized) else (right, left)
        if isinstance(sequence, sized) and isinstance(count, int):
            items = len(sequence) * count
        elif isinstance(left, int) and isinstance(right, int):
            bits = left.bit_length() + right.bit_length()
            if bits > MAX_TEMPLATE_INT_BITS:
                raise SecurityError(f"a product of {bits} bits is more than the "
                                    f"{MAX_TEMPLATE_INT_BITS} a template may make")
            return
        else:
            return
    elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        items = len(left) + len(right)
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        bits = abs(left).bit_length() * right if abs(left) > 1 else 0
        if bits > MAX_TEMPLATE_INT_BITS:
            raise SecurityError(f"a power of about {bits} bits is more than the "
                                f"{MAX_TEMPLATE_INT_BITS} a template may make")
        return
    else:
        return
    if items > MAX_TEMPLATE_ITEMS:
        raise SecurityError(f"{operator!r} would make {items} items, more than the "
                            f"{MAX_TEMPLATE_ITEMS} a template may make")


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InputError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} "
                         f"objects, got {messages!r}")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or "content" not in message:
            raise InputError(f"message {index} must be an object with a \"role\" string and a "
                             f"\"content\", got {message!r}")
