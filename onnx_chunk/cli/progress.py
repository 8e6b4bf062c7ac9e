"""Progress bars of the long-running commands: on stderr, only when it is a terminal and the
user did not pass --quiet, so piped and scripted runs print nothing but their results."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

QUIET_OPTION = click.option("-q", "--quiet", is_flag=True,
                            help="No progress display (it shows only on a terminal anyway).")


def wanted(quiet: bool) -> bool:
    """Whether to show progress: stderr is a terminal and --quiet was not given."""
    return not quiet and sys.stderr.isatty()


@contextmanager
def byte_progress(label: str, show: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A `progress(done, total)` callback drawing a bar of bytes, or None when not shown; the
    bar opens at the first call, when the total is known."""
    if not show:
        yield None
        return
    bar: Any = None
    shown = 0

    def progress(done: int, total: int) -> None:
        nonlocal bar, shown
        if bar is None:
            bar = click.progressbar(length=max(total, 1), label=label, file=sys.stderr)
            bar.__enter__()
        bar.update(done - shown)
        shown = done

    try:
        yield progress
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)


@contextmanager
def prefill_progress(prefilled: Callable[[], int], total: int, show: bool) -> Iterator[None]:
    """A bar of prompt tokens prefilled, read from `prefilled()` (the engine's own count of
    prefill rows run) every tenth of a second until the block ends; nothing when not shown."""
    if not show:
        yield
        return
    done = threading.Event()

    def follow() -> None:
        shown = 0
        with click.progressbar(length=max(total, 1), label="prefilling prompt",
                               file=sys.stderr) as bar:
            while True:
                ended = done.wait(0.1)
                now = min(prefilled(), total)
                bar.update(now - shown)
                shown = now
                if ended or now >= total:
                    return

    thread = threading.Thread(target=follow, name="onnx-chunk-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
