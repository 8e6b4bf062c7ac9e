"""Generated token ids to the text a client sees: detokenized as they come, cut at stop strings.

The one rule set of text generation, for the tokens of a `Request` of the batch engine: each
id is detokenized incrementally (`TextStream`; special tokens skipped unless
`skip_special_tokens` is False), the text goes through `StopMatcher`, and the text ends at the
end id that ended the request (EOS, or a request's `stop_token_ids`, by the engine's finish
rule, `Request.ends_at`: the id is counted, its text is not shown, as vLLM's detokenizer drops
a stop token unless `include_stop_str_in_output`) or at a stop string (the text ends before it,
or right after it with `include_stop_str_in_output`; with `min_tokens`, only in the text of the
tokens after the first `min_tokens`, as vLLM defers stop strings). With special tokens shown
and `spaces_between_special_tokens` False, an added token right after another is its own
text, without a space a decoder puts before it (added tokens; vLLM's fast detokenizer,
vllm/v1/engine/detokenizer.py). Once `stopped` is set the caller stops feeding ids; `finish`
gives what is still held.
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
                 min_tokens: int = 0, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False) -> None:
        """`ends_at(count)`: whether the `count`-th id ended the generation as an end id
        (`Request.ends_at`; by default none does); `min_tokens`: the tokens whose text no stop
        string is looked for in; the rest as vLLM's fields of those names."""
        self._min_tokens = min_tokens
        self._tokenizer = tokenizer
        self._text = TextStream(lambda ids: tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens))
        self._stops = StopMatcher(check_stops(stop), include=include_stop_str_in_output)
        self._ends_at = ends_at
        self._keep_end = include_stop_str_in_output
        self._joined = not (skip_special_tokens or spaces_between_special_tokens)
        self.tokens: list[int] = []
        self.stopped = False

    def push(self, token: int) -> str:
        """The text `token` makes safe to show ("" while held); sets `stopped` at the end."""
        self.tokens.append(int(token))
        if self._ends_at(len(self.tokens)):
            self.stopped = True
            if not self._keep_end:
                return ""
            return self._text.push(token) + self._text.finish()
        piece = self._text.push(token)
        if self._joined and len(self.tokens) > 1:
            content = self._tokenizer.added_content(token)
            if content is not None and piece.strip() == content and \
                    self._tokenizer.added_content(self.tokens[-2]) is not None:
                piece = content
        if len(self.tokens) <= self._min_tokens:
            return piece
        piece = self._stops.feed(piece)
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
