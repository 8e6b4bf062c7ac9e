"""One request of the server on the batch engine: its tokens to text, timed, ended once.

No thread per request: the engine's thread wakes the request's coroutine after each token
(`Request.watch`, a `loop.call_soon_threadsafe` of an asyncio event), which reads what came
without waiting (`Request.ready`) and turns it into text (`TokenText`: detokenization, stop
strings, EOS) and observes the latencies.
However the coroutine ends (the text stopped, the client went away, the server is draining),
its `finally` cancels the request, which frees its slot before the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator

from onnx_chunk.errors import ClosedError
from onnx_chunk.runtime.engine.request import Request
from onnx_chunk.sampling import TokenLogprobs
from onnx_chunk.serve.metrics import ServerMetrics
from onnx_chunk.text.token_text import TokenText

logger = logging.getLogger(__name__)

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
        wake = asyncio.Event()

        def woken() -> None:  # on the engine's thread
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody reads it now
                loop.call_soon_threadsafe(wake.set)

        self.request.watch(woken)
        reason = "cancelled"
        last: float | None = None
        pending: list[TokenLogprobs] = []
        seen = 0
        try:
            while not self._text.stopped:
                try:
                    tokens, logprobs, ended = self.request.ready(seen)
                except Exception:
                    reason = "error"
                    raise
                if not tokens:
                    if ended:
                        break
                    await wake.wait()
                    wake.clear()
                    continue
                seen += len(tokens)
                at = time.perf_counter()
                for token, entry in zip(tokens, logprobs):
                    if entry is not None:
                        pending.append(entry)
                    if last is None:
                        self._metrics.ttft.observe(at - self._arrived)
                    else:
                        self._metrics.inter_token.observe(at - last)
                    last = at
                    piece = self._text.push(token)
                    if piece:
                        yield piece, pending
                        pending = []
                    if self._text.stopped:
                        break
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
