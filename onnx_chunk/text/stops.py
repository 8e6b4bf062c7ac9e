"""Stop strings matched on the generated text, as OpenAI's API does.

The earliest occurrence of any stop string ends the text there: neither the stop string nor
anything after it is returned. Text that might be the start of a stop string (a suffix that is
a prefix of one) is held back until the next text settles it, so nothing a stop string would
cut is ever emitted; a stop string may span any number of tokens. With `include` (vLLM's
`include_stop_str_in_output`) the text ends right after the stop string instead, and nothing
is held back (vllm/v1/engine/detokenizer.py: no buffer when the stop string is kept).
"""

from __future__ import annotations

from collections.abc import Iterable

from onnx_chunk.errors import InputError


def check_stops(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    """The stop strings of a request: one string or several, each non-empty."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    for value in stops:
        if not isinstance(value, str) or not value:
            raise InputError(f"each stop string must be a non-empty string, got {value!r}")
    return stops


class StopMatcher:
    """Feeds text through, holding back what could begin a stop string."""

    def __init__(self, stops: Iterable[str], *, include: bool = False) -> None:
        self.stops = tuple(stops)
        self.include = include
        self._held = ""
        # With `include`: the end of the text already emitted, where a stop string may begin.
        self._tail = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that is safe to emit now; sets `stopped` when a stop string completes."""
        if self.stopped:
            return ""
        if self.include:
            return self._feed_kept(text)
        pending = self._held + text
        cut = min((index for index in (pending.find(stop) for stop in self.stops)
                   if index >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return pending[:cut]
        keep = _partial_stop(pending, self.stops)
        self._held = pending[len(pending) - keep:]
        return pending[:len(pending) - keep]

    def _feed_kept(self, text: str) -> str:
        """`feed` when the stop string is kept: `text` up to the end of the first stop string
        that ends in it."""
        window = self._tail + text
        ends = [found + len(stop) for stop in self.stops
                for found in [window.find(stop)] if found >= 0]
        if ends:
            self.stopped = True
            return window[len(self._tail):min(ends)]
        longest = max(map(len, self.stops), default=1)
        self._tail = window[len(window) - longest + 1:] if longest > 1 else ""
        return text

    def flush(self) -> str:
        """The held text, when the generation ends for another reason."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held


def _partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[len(text) - size:]):
                longest = size
                break
    return longest
