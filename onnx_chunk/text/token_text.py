"""Generated token ids to the text a client sees: detokenized as they come, cut at stop strings.

The one rule set of text generation, apart from where the tokens come from (a sequence's
token loop, or a `Request` of the batch engine): each id is detokenized incrementally
(`TextStream`, special tokens skipped), the text goes through `StopMatcher`, and the text
ends at an end id (EOS, or a request's `stop_token_ids`: the id is counted, its text is not
shown, as vLLM's detokenizer drops a stop token) or at a stop string (the text ends before
it; with `min_tokens`, only in the text of the tokens after the first `min_tokens`, as vLLM
defers stop strings). Once `stopped` is set the caller stops feeding ids; `finish` gives what
is still held.
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

    `tokens`: every id pushed; `stopped`: an end id or a stop string ended the text.
    """

    def __init__(self, tokenizer: Tokenizer, stop: str | Iterable[str] | None = None, *,
                 end_ids: Iterable[int] | None = None, min_tokens: int = 0) -> None:
        """`end_ids`: the ids the generation ends at (None: the tokenizer's EOS ids);
        `min_tokens`: the tokens whose text no stop string is looked for in."""
        self._min_tokens = min_tokens
        self._text = TextStream(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self._stops = StopMatcher(check_stops(stop))
        self._eos = frozenset(tokenizer.eos_token_ids if end_ids is None else end_ids)
        self.tokens: list[int] = []
        self.stopped = False

    def push(self, token: int) -> str:
        """The text `token` makes safe to show ("" while held); sets `stopped` at the end."""
        self.tokens.append(int(token))
        if token in self._eos:
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
