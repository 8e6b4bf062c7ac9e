"""The event stream of a streamed answer, as an ASGI response that notices a client leaving at
once (Starlette's StreamingResponse notices only at its next write), and the wait for a whole
answer that a disconnect cancels."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from starlette.types import Receive, Scope, Send

_T = TypeVar("_T")


async def unless_disconnected(work: Awaitable[_T], receive: Receive) -> _T | None:
    """`work`'s result, or None when the client disconnected first (`work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream:
    """An ASGI response streaming server-sent events that watches for the client leaving:
    a disconnect cancels the stream at once (Starlette's StreamingResponse only notices one
    at its next write), then `on_end` runs."""

    def __init__(self, events: AsyncGenerator[bytes, None], on_end: Callable[[], None]) -> None:
        self._events = events
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            await unless_disconnected(self._pump(send), receive)
        except OSError:  # the client went away during a write
            pass
        finally:
            await self._events.aclose()
            self._on_end()

    async def _pump(self, send: Send) -> str:
        async for chunk in self._events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return ""
