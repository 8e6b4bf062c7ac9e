"""Generated token ids to the text a client sees: detokenized as they come, cut at stop strings.

The one rule set of text generation, for the tokens of a `Request` of the batch engine: each
id is detokenized incrementally (`TextStream`, special tokens skipped), the text goes through
`StopMatcher`, and the text ends at the end id that ended the request (EOS, or a request's
`stop_token_ids`, by the engine's finish rule, `Request.ends_at`: the id is counted, its text
is not shown, as vLLM's detokenizer drops a stop token) or at a stop string (the text ends
before it; with `min_tokens`, only in the text of the tokens after the first `min_tokens`, as
vLLM defers stop strings). Once `stopped` is set the caller stops feeding ids; `finish` gives
what is still held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from onnx_chunk.text.stops import StopMatcher, check_stops
from onnx_chunk.text.stream import TextStream

if TYPE_CHECKING:
    from onnx_chunk.text.tokenizer import Tokenizer


class TokenText:
    """Feeds generated ids through detokenization and stop strings (see the module docstring).

    `tokens`: every id pushed; `stopped`: an end id or a stop string ended the text.
    """

    def __init__(self, tokenizer: Tokenizer, stop: str | Iterable[str] | None = None, *,
                 ends_at: Callable[[int], bool] = lambda count: False,
                 min_tokens: int = 0) -> None:
        """`ends_at(count)`: whether the `count`-th id ended the generation as an end id
        (`Request.ends_at`; by default none does); `min_tokens`: the tokens whose text no stop
        string is looked for in."""
        self._min_tokens = min_tokens
        self._text = TextStream(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self._stops = StopMatcher(check_stops(stop))
        self._ends_at = ends_at
        self.tokens: list[int] = []
        self.stopped = False

    def push(self, token: int) -> str:
        """The text `token` makes safe to show ("" while held); sets `stopped` at the end."""
        self.tokens.append(int(token))
        if self._ends_at(len(self.tokens)):
            self.stopped = True
            return ""
        if len(self.tokens) <= self._min_tokens:
            return self._text.push(token)
        piece = self._stops.feed(self._text.push(token))
        self.stopped = self._stops.stopped
        return piece

    def finish(self) -> str:
        """What is still held, once no more ids come (nothing after a stop string)."""
        if self._stops.stopped:
            return ""
        piece = self._stops.feed(self._text.finish())
        if self._stops.stopped:
            self.stopped = True
            return piece
        return piece + self._stops.flush()
