"""uvicorn around the app: a bound socket in, served until a signal (or `should_exit`) drains.

The exit signal (SIGTERM, SIGINT) first drains the app (no new request admitted, running
requests ended, streams closed with an error event), then lets uvicorn close the connections;
the drained exit is a clean one: the signal is not raised again after the shutdown, so the
process exits 0. Off the main thread (a test's server) no signal is captured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn
from starlette.applications import Starlette

DRAIN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Seconds uvicorn waits for connections to close once draining has ended their requests.
GRACEFUL_S = 30
# The interpreter's thread switch interval while serving (CPython's default is 5 ms): the
# event loop gives up the GIL at each socket call, and a worker thread building an answer
# holds it up to this long each time the loop wants it back, so a /health answer of a few
# dozen such calls would wait 5 ms times that.
SWITCH_INTERVAL_S = 0.0005


class ShortSwitchInterval:
    """The interval is the process's: set by the first server serving, restored by the last
    to stop (servers in one process, as tests run them, stop in any order)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._serving = 0
        self._previous = 0.0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._serving == 0:
                self._previous = sys.getswitchinterval()
                sys.setswitchinterval(SWITCH_INTERVAL_S)
            self._serving += 1
        try:
            yield
        finally:
            with self._lock:
                self._serving -= 1
                if self._serving == 0:
                    sys.setswitchinterval(self._previous)


SWITCH_INTERVAL = ShortSwitchInterval()


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose exit drains the app first (see the module docstring)."""

    def __init__(self, app: Starlette, *, log_level: int = logging.WARNING) -> None:
        super().__init__(uvicorn.Config(app, log_config=None, access_log=False,
                                        log_level=log_level,
                                        timeout_graceful_shutdown=GRACEFUL_S))
        self._drain: Callable[[], None] = app.state.service.drain
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        with SWITCH_INTERVAL.held():
            await super().serve(sockets)

    def stop(self) -> None:
        """Drain and exit, as the signal does (callable from any thread)."""
        self.handle_exit(signal.SIGTERM, None)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is not None and not self.should_exit:
            self._loop.call_soon_threadsafe(self._drain)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {signum: signal.signal(signum, self.handle_exit)
                    for signum in DRAIN_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one); OSError when it cannot."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                         type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(2048)
    except BaseException:
        listener.close()
        raise
    return listener
