"""Generated token ids to the text a client sees: detokenized as they come, cut at stop strings.

The one rule set of text generation, apart from where the tokens come from (a sequence's
token loop, or a `Request` of the batch engine): each id is detokenized incrementally
(`TextStream`, special tokens skipped), the text goes through `StopMatcher`, and the text
ends at an EOS id (the id is counted, its text is not shown), at another end id (a request's
`stop_token_ids`: its text is shown, as vLLM does, unless it is a special token) or at a stop
string (the text ends before it). Once `stopped` is set the caller stops feeding ids; `finish` gives what is
still held.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from onnx_chunk.text.stops import StopMatcher, check_stops
from onnx_chunk.text.stream import TextStream

if TYPE_CHECKING:
    from onnx_chunk.text.tokenizer import Tokenizer


class TokenText:
    """Feeds generated ids through detokenization and stop strings (see the module docstring).

    `tokens`: every id pushed; `stopped`: an EOS id or a stop string ended the text.
    """

    def __init__(self, tokenizer: Tokenizer, stop: str | Iterable[str] | None = None, *,
                 end_ids: Iterable[int] | None = None) -> None:
        """`end_ids`: the ids the generation ends at (None: the tokenizer's EOS ids)."""
        self._text = TextStream(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self._stops = StopMatcher(check_stops(stop))
        ends = frozenset(tokenizer.eos_token_ids if end_ids is None else end_ids)
        self._eos = ends & frozenset(tokenizer.eos_token_ids)
        self._ends = ends - self._eos
        self.tokens: list[int] = []
        self.stopped = False
        self._finished = False

    def push(self, token: int) -> str:
        """The text `token` makes safe to show ("" while held); sets `stopped` at the end."""
        self.tokens.append(int(token))
        if token in self._eos:
            self.stopped = True
            return ""
        piece = self._stops.feed(self._text.push(token))
        self.stopped = self._stops.stopped
        if token in self._ends and not self.stopped:
            piece += self.finish()
            self.stopped = True
        return piece

    def finish(self) -> str:
        """What is still held, once no more ids come (nothing after a stop string)."""
        if self._stops.stopped or self._finished:
            return ""
        self._finished = True
        piece = self._stops.feed(self._text.finish())
        if self._stops.stopped:
            self.stopped = True
            return piece
        return piece + self._stops.flush()
