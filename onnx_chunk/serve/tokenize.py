"""vLLM's /tokenize and /detokenize: the server's tokenizer and chat template over HTTP.

/tokenize takes {"prompt": str, "add_special_tokens": true} or {"messages": [...],
"add_generation_prompt": true, "tools": [...]}, each with an optional "return_token_strs",
and answers {"count", "max_model_len", "tokens", "token_strs"}: the ids a generation request
with the same prompt is fed, through the same functions (`Tokenizer.encode_chat` with the
server's special-token policy, the tools checked as chat checks them). A prompt over the
context is refused (400) before it is encoded, as a generation request's is.
/detokenize takes {"tokens": [ids]} and answers {"prompt": text}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from onnx_chunk.errors import CapacityError
from onnx_chunk.serve.protocol import RequestError, _shown, parse_chat

if TYPE_CHECKING:
    from onnx_chunk.text.tokenizer import Tokenizer


def tokenize(body: object, tokenizer: Tokenizer, capacity: int,
             check_model: Callable[[object], None],
             special_in_content: bool = False) -> dict[str, Any]:
    """The answer of /tokenize (see the module docstring); `special_in_content`: the server's
    policy for special tokens typed in messages (as chat applies it)."""
    from onnx_chunk.serve.parameters import parse_tools

    body = _object(body, TOKENIZE_FIELDS)
    check_model(body.get("model"))
    try:
        if "messages" in body:
            messages = parse_chat({"messages": body.get("messages")}).messages
            if _flag(body, "add_special_tokens", False):
                raise RequestError("'add_special_tokens' cannot be true with 'messages': the "
                                   "chat template writes the special tokens",
                                   param="add_special_tokens")
            tools, _ = parse_tools(body)
            ids = tokenizer.encode_chat(
                list(messages), add_generation_prompt=_flag(body, "add_generation_prompt", True),
                special_in_content=special_in_content, max_tokens=capacity,
                tools=list(tools) or None)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise RequestError(f"'prompt' must be a string (or send 'messages'), got "
                                   f"{_shown(prompt)}", param="prompt")
            tokenizer.check_fits(prompt, capacity)
            ids = tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens",
                                                                    True))
    except CapacityError as error:
        raise RequestError(str(error), param="messages" if "messages" in body else "prompt",
                           code="context_length_exceeded") from error
    strings = ([tokenizer.id_to_token(token) for token in ids]
               if _flag(body, "return_token_strs", False) else None)
    return {"count": len(ids), "max_model_len": capacity, "tokens": ids, "token_strs": strings}


def detokenize(body: object, tokenizer: Tokenizer,
               check_model: Callable[[object], None]) -> dict[str, Any]:
    """The answer of /detokenize: {"prompt": the text of "tokens"}."""
    body = _object(body, DETOKENIZE_FIELDS)
    check_model(body.get("model"))
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(token, int) and not isinstance(token, bool)
            and 0 <= token < tokenizer.vocab_size for token in tokens):
        raise RequestError(f"'tokens' must be a list of token ids in [0, "
                           f"{tokenizer.vocab_size}), got {_shown(tokens)}", param="tokens")
    return {"prompt": tokenizer.decode(tokens)}


# The fields each endpoint knows (another one: 400 `unknown_parameter`).
TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens",
                             "add_generation_prompt", "tools", "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _object(body: object, known: frozenset[str]) -> dict[str, Any]:
    from onnx_chunk.serve.parameters import unknown_field

    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_shown(body)}")
    unknown = sorted(name for name in body if name not in known)
    if unknown:
        raise unknown_field(unknown[0])
    return body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean, got {_shown(value)}", param=name)
    return value
