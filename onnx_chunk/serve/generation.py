"""One request of the server on the batch engine: its tokens to text, timed, ended once.

The engine's `Request.tokens()` blocks its reader, so one bridge thread per request reads it
and hands each token (with the time it came) to the event loop; the server's coroutine turns
them into text (`TokenText`: detokenization, stop strings, EOS) and observes the latencies.
However the coroutine ends (the text stopped, the client went away, the server is draining),
its `finally` cancels the request, which frees its slot before the engine's next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator

from onnx_chunk.errors import ClosedError
from onnx_chunk.runtime.engine.request import Request
from onnx_chunk.sampling import TokenLogprobs
from onnx_chunk.serve.metrics import ServerMetrics
from onnx_chunk.text.token_text import TokenText

logger = logging.getLogger(__name__)

_END = object()


class ShuttingDown(ClosedError):
    """The server began draining while this request ran."""


class ServedGeneration:
    """A submitted request and the text it makes; iterate `pieces()` once.

    `finish_reason` ("stop", "length"; "cancelled" or "error" when it did not end normally)
    and `completion_tokens` are set once `pieces()` has ended.
    """

    def __init__(self, request: Request, text: TokenText, prompt_tokens: int, arrived: float,
                 metrics: ServerMetrics, index: int = 0) -> None:
        """`index`: the choice's index in the answer."""
        self.request = request
        self.index = index
        self.prompt_tokens = prompt_tokens
        self.finish_reason: str | None = None
        self.shutdown = False
        self._text = text
        self._arrived = arrived
        self._metrics = metrics

    @property
    def completion_tokens(self) -> int:
        return len(self._text.tokens)

    def end_for_shutdown(self) -> None:
        """Stop it because the server is draining (`pieces()` raises ShuttingDown)."""
        self.shutdown = True
        self.request.cancel()

    async def pieces(self) -> AsyncGenerator[str, None]:
        """The text as it is produced; raises the request's error, or ShuttingDown."""
        chunks = self.chunks()
        try:
            async for piece, _ in chunks:
                if piece:
                    yield piece
        finally:
            await chunks.aclose()

    async def chunks(self) -> AsyncGenerator[tuple[str, list[TokenLogprobs]], None]:
        """The text as it is produced, each piece with the logprobs of the tokens pushed since
        the previous piece (empty when the request asked for none; the last piece may be ""
        to carry the last tokens' logprobs); raises the request's error, or ShuttingDown."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        threading.Thread(target=_bridge, args=(self.request, loop, queue),
                         name=f"onnx-chunk-serve-{self.request.id}", daemon=True).start()
        reason = "cancelled"
        last: float | None = None
        pending: list[TokenLogprobs] = []
        try:
            while not self._text.stopped:
                item = await queue.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    reason = "error"
                    raise item
                token, logprobs, at = item
                if logprobs is not None:
                    pending.append(logprobs)
                if last is None:
                    self._metrics.ttft.observe(at - self._arrived)
                else:
                    self._metrics.inter_token.observe(at - last)
                last = at
                piece = self._text.push(token)
                if piece:
                    yield piece, pending
                    pending = []
            piece = self._text.finish()
            if piece or pending:
                yield piece, pending
            reason = self._reason()
        finally:
            self._end(reason)
        if reason == "cancelled" and self.shutdown:
            raise ShuttingDown("the server is shutting down; retry on another replica or later")

    def close(self) -> None:
        """End it, if `pieces()` never ran to its end (a client gone before its stream began)."""
        if self.finish_reason is None:
            self._end("cancelled")

    def _end(self, reason: str) -> None:
        self.request.cancel()
        self.finish_reason = reason
        self._metrics.requests.labels(finish_reason=reason).inc()

    def _reason(self) -> str:
        if self._text.stopped:
            return "stop"
        return self.request.finish_reason or "cancelled"


def _bridge(request: Request, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
    """Hand `request`'s tokens to the event loop as they come, then its end (or its error)."""
    def put(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody reads this request any more
            request.cancel()

    try:
        for token, logprobs in request.steps():
            put((token, logprobs, time.perf_counter()))
    except Exception as error:  # the request failed: its reader raises it
        put(error)
    else:
        put(_END)
