"""Stop strings matched on the generated text, as OpenAI's API does.

The earliest occurrence of any stop string ends the text there: neither the stop string nor
anything after it is returned. Text that might be the start of a stop string (a suffix that is
a prefix of one) is held back until the next text settles it, so nothing a stop string would
cut is ever emitted; a stop string may span any number of tokens.
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

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that is safe to emit now; sets `stopped` when a stop string completes."""
        if self.stopped:
            return ""
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
