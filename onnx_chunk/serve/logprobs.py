"""Token logprobs in OpenAI's two shapes: chat's `logprobs.content` and completions' legacy one.

The numbers come from the sampler (`onnx_chunk.sampling.TokenLogprobs`: the log-softmax of the
distribution each token was chosen from) and, for `echo` and `prompt_logprobs`, from the
prefill (the raw logits of the position before each prompt token). A token's text is its id
decoded alone, special tokens included; `bytes` are that text's UTF-8 bytes. `TokenIds` names
tokens "token_id:N" instead (vLLM's `return_tokens_as_token_ids`; `bytes` stay the token's).
JSON has no -inf: a token the request's top-k, top-p, min-p or typical-p cut (log-probability
-inf) is sent as -9999.0, as vLLM sends it. `prompt_logprobs` writes vLLM's format: per prompt
token (null for the first) an object of token id to {"logprob", "rank", "decoded_token"}.
"""

from __future__ import annotations

import codecs
import functools
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from onnx_chunk.sampling import TokenLogprobs

if TYPE_CHECKING:
    from onnx_chunk.text.tokenizer import Tokenizer

# What -inf is sent as.
FLOOR = -9999.0


class TokenStrings:
    """Each token id's text, decoded alone once and remembered (one tokenizer's), and its
    bytes.

    A token that is part of a UTF-8 character (it decodes to U+FFFD alone) is shown as OpenAI
    shows it, `bytes:\\xe2\\x80`: its own bytes, read from a byte-level vocabulary piece
    (GPT-2's byte-to-character map), so two such tokens never share a text.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token: int) -> str:
        return self._entry(token)[0]

    def raw(self, token: int) -> bytes:
        """The token's bytes."""
        return self._entry(token)[1]

    def _entry(self, token: int) -> tuple[str, bytes]:
        entry = self._texts.get(token)
        if entry is None:
            text = self._tokenizer.decode([token])
            entry = (text, text.encode("utf-8"))
            if "\ufffd" in text:
                piece = self._tokenizer.id_to_token(token) or ""
                raw = _byte_level(piece)
                if raw is not None:
                    entry = ("bytes:" + "".join(f"\\x{byte:02x}" for byte in raw), raw)
            self._texts[token] = entry
        return entry


class TokenIds(TokenStrings):
    """Tokens named "token_id:N" (vLLM's `return_tokens_as_token_ids`), their bytes their own."""

    def __call__(self, token: int) -> str:
        return f"token_id:{token}"


def _byte_level(piece: str) -> bytes | None:
    """The bytes a byte-level BPE piece stands for (None when it is not one)."""
    table = _unicode_to_byte()
    if not piece or any(character not in table for character in piece):
        return None
    return bytes(table[character] for character in piece)


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's map of the 256 byte values to printable characters, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    characters = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return {chr(character): byte for byte, character in zip(printable, characters)}


def _number(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def chat_content(entries: Iterable[TokenLogprobs], strings: TokenStrings) -> list[dict[str, Any]]:
    """Chat's `logprobs.content`: per token its text, logprob, bytes and `top_logprobs`."""
    return [{**_chat_token(entry.token, entry.logprob, strings),
             "top_logprobs": [_chat_token(token, logprob, strings)
                              for token, logprob in entry.top]}
            for entry in entries]


def _chat_token(token: int, logprob: float, strings: TokenStrings) -> dict[str, Any]:
    return {"token": strings(token), "logprob": _number(logprob),
            "bytes": list(strings.raw(token))}


class CompletionLogprobs:
    """Completions' legacy `logprobs`: `tokens`, `token_logprobs`, `top_logprobs` (a
    {text: logprob} object per token, null where the token has none) and `text_offset` (each
    token's first character in the choice's text: the characters its bytes and the earlier
    tokens' complete, so a token holding part of a character, shown as `bytes:\\xNN`, counts
    none of its label), built token by token."""

    def __init__(self, strings: TokenStrings, offset: int = 0) -> None:
        self._strings = strings
        self.offset = offset
        self._characters = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def part(self, entries: Iterable[TokenLogprobs | None],
             tokens: Iterable[int] | None = None, top: int | None = None
             ) -> dict[str, list[Any]]:
        """The next tokens' lists; `tokens` gives the ids where an entry is None (the first
        prompt token of an echo); `top`: the most likely tokens shown at most (None: all the
        entries hold)."""
        entries = list(entries)
        ids = list(tokens) if tokens is not None else [
            entry.token for entry in entries if entry is not None]
        part: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                      "text_offset": []}
        for token, entry in zip(ids, entries):
            text = self._strings(token)
            part["tokens"].append(text)
            part["text_offset"].append(self.offset)
            self.offset += len(self._characters.decode(self._strings.raw(token)))
            if entry is None:
                part["token_logprobs"].append(None)
                part["top_logprobs"].append(None)
                continue
            part["token_logprobs"].append(_number(entry.logprob))
            part["top_logprobs"].append({self._strings(token): _number(logprob)
                                         for token, logprob in entry.top[:top]})
        return part


def joined(parts: Iterable[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """Several `CompletionLogprobs.part`s as one."""
    whole: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                   "text_offset": []}
    for part in parts:
        for key, values in part.items():
            whole[key].extend(values)
    return whole


def prompt_logprobs(entries: Iterable[TokenLogprobs | None], top: int,
                    strings: TokenStrings) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) the token and the `top`
    most likely tokens, each {"logprob", "rank", "decoded_token"}; a top token that is the
    prompt's own keeps its place in the top (vllm/v1/engine/logprobs.py builds the same
    dictionary, the prompt token first)."""
    shown: list[dict[int, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            shown.append(None)
            continue
        position = {entry.token: {"logprob": _number(entry.logprob), "rank": entry.rank,
                                  "decoded_token": strings(entry.token)}}
        for rank, (token, logprob) in enumerate(entry.top[:top], 1):
            position[token] = {"logprob": _number(logprob), "rank": rank,
                               "decoded_token": strings(token)}
        shown.append(position)
    return shown
