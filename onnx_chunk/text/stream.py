"""Incremental detokenization: the text each new token adds, never a broken character.

A token's text depends on its neighbours (byte-level BPE splits a multi-byte UTF-8 character
across tokens; SentencePiece's metaspace decoders drop the leading space of the first token
decoded). So each step decodes a short window twice, the tokens already shown and the window
with the new token, both starting a little before the new token, and emits what the second
adds to the first, once it does not end in U+FFFD (an incomplete character, held until the
next token completes it). The window restarts where the last emission ended, which is always
a character boundary. `finish` emits what was held, so the concatenated output equals the
decode of every token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """Turns a stream of token ids into text deltas; `decode` maps ids to text."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._window = 0   # the context the next delta is decoded after
        self._shown = 0    # ids whose text has been emitted

    def push(self, token_id: int) -> str:
        """The text `token_id` completes ("" while it may still be part of a character)."""
        self._ids.append(int(token_id))
        before = self._decode(self._ids[self._window:self._shown])
        after = self._decode(self._ids[self._window:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT) \
                or not after.startswith(before):
            return ""
        self._window, self._shown = self._shown, len(self._ids)
        return after[len(before):]

    def finish(self) -> str:
        """What is still held (an incomplete character at the very end decodes as U+FFFD)."""
        before = self._decode(self._ids[self._window:self._shown])
        after = self._decode(self._ids[self._window:])
        self._window = self._shown = len(self._ids)
        return after[len(before):] if after.startswith(before) else ""
