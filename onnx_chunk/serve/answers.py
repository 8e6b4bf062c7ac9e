"""The response objects of the generation endpoints: whole answers and streamed chunks.

`ChatAnswer` (chat.completion, chat.completion.chunk) and `TextAnswer` (text_completion) build
each choice from a `ServedGeneration`'s text and logprobs; `usage` counts the tokens;
`event` writes one server-sent event. A completions answer echoes each prompt and builds its
prompt logprobs once per prompt (its `n` choices share them); `prompt_logprobs` (vLLM's) go
on each completions choice and once on a chat answer; with `return_tokens_as_token_ids` the
logprobs name their tokens "token_id:N".
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from onnx_chunk.sampling import TokenLogprobs
from onnx_chunk.serve.generation import ServedGeneration
from onnx_chunk.serve.logprobs import (
    CompletionLogprobs,
    TokenStrings,
    chat_content,
    joined,
    prompt_logprobs,
)
from onnx_chunk.serve.tools import tool_message


def encode_json(payload: object) -> bytes:
    """A whole answer or an event's JSON (UTF-8, compact, as Starlette's JSONResponse)."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode()



async def collect_chunks(generation: ServedGeneration) -> tuple[str, list[TokenLogprobs]]:
    """A choice's whole text and its tokens' logprobs."""
    texts: list[str] = []
    entries: list[TokenLogprobs] = []
    async with contextlib.aclosing(generation.chunks()) as chunks:
        async for piece, logprobs in chunks:
            texts.append(piece)
            entries.extend(logprobs)
    return "".join(texts), entries


def delta(message: dict[str, Any]) -> dict[str, Any]:
    """A whole message as one streamed delta (tool calls with their index)."""
    calls = message.get("tool_calls")
    if calls:
        message["tool_calls"] = [{"index": index, **call} for index, call in enumerate(calls)]
    return message



def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + encode_json(payload) + b"\n\n"


def usage(generations: list[ServedGeneration], n: int) -> dict[str, Any]:
    """Tokens of every prompt (once, however many of its `n` choices there are) and of every
    choice; `prompt_tokens_details.cached_tokens`: the prompt ids whose KV a slot kept from an
    earlier request (prefix reuse), as OpenAI and vLLM report them."""
    firsts = [generation for generation in generations if generation.index % n == 0]
    prompt = sum(generation.prompt_tokens for generation in firsts)
    cached = sum(generation.request.stats.cached_tokens for generation in firsts)
    completion = sum(generation.completion_tokens for generation in generations)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Answer(abc.ABC):
    """The response objects of one endpoint (one id and creation time per request):
    `opening` and `closing` are the first and last chunks' contents; `top`: the request's
    logprobs count (None: no logprobs); `prompt_top`: its `prompt_logprobs` (None: none);
    `names`: how logprobs name a token (default: its text, `strings`); `request_id`: the
    client's (vLLM's), which the id then carries; `continuous_usage`: every chunk carries its
    choice's usage so far (vLLM's `stream_options.continuous_usage_stats`)."""

    object_name: str
    chunk_name: str
    prefix: str
    opening: Any
    closing: Any

    # Whether the answer is made from the whole output (tool calls), not piece by piece.
    whole_output = False

    def message(self, text: str, finish_reason: str | None
                ) -> tuple[dict[str, Any], str | None]:
        """The message of the whole output and its finish reason (`whole_output` answers)."""
        raise TypeError(f"{type(self).__name__} answers piece by piece, not from the whole "
                        "output")

    def logprobs(self, entries: list[TokenLogprobs]) -> Any:
        """The logprobs of a whole output's tokens (`whole_output` answers)."""
        raise TypeError(f"{type(self).__name__} answers piece by piece, not from the whole "
                        "output")

    def __init__(self, model: str, strings: TokenStrings, top: int | None, *,
                 prompt_top: int | None = None, names: TokenStrings | None = None,
                 request_id: str | None = None, continuous_usage: bool = False) -> None:
        self.model = model
        self.strings = strings
        self.names = names or strings
        self.top = top
        self.prompt_top = prompt_top
        self.continuous_usage = continuous_usage
        self.id = f"{self.prefix}-{uuid.uuid4().hex if request_id is None else request_id}"
        self.created = int(time.time())

    def _head(self, name: str) -> dict[str, Any]:
        return {"id": self.id, "object": name, "created": self.created, "model": self.model}

    def whole(self, choices: list[dict[str, Any]], usage: dict[str, Any],
              generations: list[ServedGeneration] | None = None) -> dict[str, Any]:
        """The whole answer (with what it carries once, from `generations`)."""
        return {**self._head(self.object_name), "choices": choices, "usage": usage}

    def _prompt_logprobs(self, generation: ServedGeneration) -> list[Any]:
        """vLLM's `prompt_logprobs` of the generation's prompt."""
        assert self.prompt_top is not None  # asked for only then
        return prompt_logprobs(generation.request.prompt_logprobs, self.prompt_top,
                               self.strings)

    def chunk(self, index: int, piece: Any, finish_reason: str | None,
              logprobs: Any = None) -> dict[str, Any]:
        return {**self._head(self.chunk_name),
                "choices": [self.chunk_choice(index, piece, finish_reason, logprobs)]}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(self.chunk_name), "choices": [], "usage": usage}

    @abc.abstractmethod
    def choice(self, generation: ServedGeneration, text: str,
               entries: list[TokenLogprobs]) -> dict[str, Any]:
        """The choice of the whole answer."""

    @abc.abstractmethod
    def chunk_choice(self, index: int, piece: Any, finish_reason: str | None,
                     logprobs: Any) -> dict[str, Any]:
        """The choice of one streamed chunk."""

    @abc.abstractmethod
    def stream(self, generation: ServedGeneration) -> AsyncGenerator[tuple[str, Any], None]:
        """A streamed choice's pieces, each with its chunk's logprobs."""

    async def events(self, generation: ServedGeneration) -> AsyncGenerator[bytes, None]:
        """A streamed choice's events: opened, its pieces (a tool answer as one delta once
        the output is whole), closed with its finish reason."""
        index = generation.index
        counted = self._counted
        yield event(counted(self.chunk(index, self.opening, None), generation))
        if self.whole_output:
            text, entries = await collect_chunks(generation)
            message, reason = self.message(text, generation.finish_reason)
            message.pop("role")
            yield event(counted(self.chunk(index, delta(message), None, self.logprobs(entries)),
                                generation))
        else:
            async with contextlib.aclosing(self.stream(generation)) as pieces:
                async for piece, logprobs in pieces:
                    chunk = counted(self.chunk(index, piece, None, logprobs), generation)
                    if isinstance(logprobs, dict) and len(logprobs.get("tokens", ())) > 64:
                        yield await asyncio.to_thread(event, chunk)  # an echoed prompt's
                    else:
                        yield event(chunk)
            reason = generation.finish_reason
        yield event(counted(self.chunk(index, self.closing, reason), generation))

    def _counted(self, chunk: dict[str, Any], generation: ServedGeneration) -> dict[str, Any]:
        """`chunk` with its choice's usage so far, where `continuous_usage` asks for it."""
        if self.continuous_usage:
            done = generation.completion_tokens
            chunk["usage"] = {"prompt_tokens": generation.prompt_tokens,
                              "completion_tokens": done,
                              "total_tokens": generation.prompt_tokens + done}
        return chunk


class ChatAnswer(Answer):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"
    prefix = "chatcmpl"
    opening = {"role": "assistant", "content": ""}
    closing: dict[str, str] = {}

    def __init__(self, model: str, strings: TokenStrings, top: int | None,
                 tool_choice: str = "none", **logprobs: Any) -> None:
        super().__init__(model, strings, top, **logprobs)
        self.tool_choice = tool_choice
        self.whole_output = tool_choice != "none"

    def whole(self, choices: list[dict[str, Any]], usage: dict[str, Any],
              generations: list[ServedGeneration] | None = None) -> dict[str, Any]:
        answer = super().whole(choices, usage)
        if self.prompt_top is not None and generations:
            answer["prompt_logprobs"] = self._prompt_logprobs(generations[0])
        return answer

    def message(self, text: str, finish_reason: str | None
                ) -> tuple[dict[str, Any], str | None]:
        """The assistant message of the whole output and its finish reason (tool calls)."""
        return tool_message(text, finish_reason, self.tool_choice)

    def logprobs(self, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        """Chat's `logprobs` of these tokens (None when the request asked for none)."""
        return None if self.top is None else {"content": chat_content(entries, self.names)}

    def choice(self, generation: ServedGeneration, text: str,
               entries: list[TokenLogprobs]) -> dict[str, Any]:
        message, finish_reason = self.message(text, generation.finish_reason)
        return {"index": generation.index, "message": message,
                "logprobs": self.logprobs(entries), "finish_reason": finish_reason}

    def chunk_choice(self, index: int, piece: Any, finish_reason: str | None,
                     logprobs: Any) -> dict[str, Any]:
        delta = {"content": piece} if isinstance(piece, str) else piece
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason}

    async def stream(self, generation: ServedGeneration
                     ) -> AsyncGenerator[tuple[str, Any], None]:
        async with contextlib.aclosing(generation.chunks()) as chunks:
            async for piece, entries in chunks:
                yield piece, self.logprobs(entries)


class TextAnswer(Answer):
    """Completions' answer; `echoes`: each prompt's text when the request echoes them; `n`:
    the choices per prompt."""

    object_name = "text_completion"
    chunk_name = "text_completion"
    prefix = "cmpl"
    opening = ""
    closing = ""

    def __init__(self, model: str, strings: TokenStrings, top: int | None,
                 echoes: list[str] | None, n: int, **logprobs: Any) -> None:
        super().__init__(model, strings, top, **logprobs)
        self.echoes = echoes
        self.n = n
        self._echoed: dict[int, tuple[str, dict[str, list[Any]] | None]] = {}
        self._prompts: dict[int, list[Any]] = {}
        self._lock = threading.Lock()

    def choice(self, generation: ServedGeneration, text: str,
               entries: list[TokenLogprobs]) -> dict[str, Any]:
        echo, part = self._echo(generation)
        logprobs = None
        if self.top is not None:
            builder = CompletionLogprobs(self.names, len(echo))
            logprobs = joined([*([] if part is None else [part]), builder.part(entries)])
        choice = {"index": generation.index, "text": echo + text, "logprobs": logprobs,
                  "finish_reason": generation.finish_reason}
        if self.prompt_top is not None:
            choice["prompt_logprobs"] = self._shared_prompt_logprobs(generation)
        return choice

    def _shared_prompt_logprobs(self, generation: ServedGeneration) -> list[Any]:
        """vLLM's `prompt_logprobs` of the choice's prompt, built once per prompt."""
        number = generation.index // self.n
        with self._lock:
            built = self._prompts.get(number)
            if built is None:
                built = self._prompts[number] = self._prompt_logprobs(generation)
        return built

    def _echo(self, generation: ServedGeneration) -> tuple[str, dict[str, list[Any]] | None]:
        """The echoed prompt's text and its logprobs (when asked for), built once per prompt
        and shared by its `n` choices; the choice's own offsets go on after that text."""
        if self.echoes is None:
            return "", None
        number = generation.index // self.n
        with self._lock:
            echoed = self._echoed.get(number)
            if echoed is None:
                request = generation.request
                part = None if self.top is None else CompletionLogprobs(self.names).part(
                    request.prompt_logprobs, request.prompt.tolist(), top=self.top)
                echoed = self._echoed[number] = (self.echoes[number], part)
        return echoed

    def chunk_choice(self, index: int, piece: Any, finish_reason: str | None,
                     logprobs: Any) -> dict[str, Any]:
        return {"index": index, "text": piece, "logprobs": logprobs,
                "finish_reason": finish_reason}

    async def stream(self, generation: ServedGeneration
                     ) -> AsyncGenerator[tuple[str, Any], None]:
        builder = CompletionLogprobs(self.names)
        echoed = self.echoes is None
        async with contextlib.aclosing(generation.chunks()) as chunks:
            async for piece, entries in chunks:
                if not echoed:
                    # The prompt's logprobs are whole once its first token came.
                    echoed = True
                    echo, part = await asyncio.to_thread(self._echo, generation)
                    builder.offset = len(echo)
                    yield echo, part
                yield piece, None if self.top is None else builder.part(entries)
        if not echoed:
            yield await asyncio.to_thread(self._echo, generation)
