"""Text generation around a token source: prompt to ids, ids to streamed text, stops.

The tokens come from the batch engine (`EngineTokens`: `runtime.submit`, the path of
`generate_text(runtime, ...)`, `stream_text`, `generate --prompt`, chat turns and the server).

A prompt is text or a list of messages, encoded by `PromptEncoder` (onnx_chunk.text.prompt,
the one encoder: text with the tokenizer's special tokens, messages through the chat template,
the special tokens typed in them parsed as control tokens, as transformers does). The text
is the decode of the new tokens without special tokens, streamed through `TextStream`, cut by
`StopMatcher`. A generation ends, and its `finish_reason` says why, at:
- "stop": an EOS id (the token is in `tokens`, not in the text) or a stop string (the text
  ends before it; `tokens` include the token that completed it);
- "length": `max_new_tokens` tokens;
- "capacity": the KV capacity, when it holds fewer than `max_new_tokens` more.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from onnx_chunk.errors import CapacityError, ConfigError
from onnx_chunk.runtime.engine.request import RequestStats
from onnx_chunk.sampling import GREEDY, Sampling, TokenLogprobs
from onnx_chunk.text.prompt import Prompt, PromptEncoder
from onnx_chunk.text.stops import check_stops
from onnx_chunk.text.token_text import TokenText
from onnx_chunk.text.tokenizer import tokenizer_of

if TYPE_CHECKING:
    from onnx_chunk.runtime.engine.request import Request
    from onnx_chunk.runtime.facade import Runtime
    from onnx_chunk.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Completion:
    """One text generation: its text, new tokens, why it ended, and its statistics (timings,
    left out of equality)."""

    text: str
    tokens: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    stats: RequestStats | None = field(default=None, compare=False)
    # Per token of `tokens`, its logprobs (when the request asked for them).
    logprobs: tuple[TokenLogprobs, ...] = ()


def end_ids(tokenizer: Tokenizer, *, ignore_eos: bool = False,
            stop_token_ids: Iterable[int] = ()) -> tuple[int, ...]:
    """The ids a generation ends at: `stop_token_ids`, and the tokenizer's EOS ids unless
    `ignore_eos` (then only max_new_tokens, the capacity or a stop string end it)."""
    eos = () if ignore_eos else tokenizer.eos_token_ids
    return tuple(dict.fromkeys((*(int(token) for token in stop_token_ids), *eos)))


def default_sampling(tokenizer: Tokenizer, sampling: Sampling | None) -> Sampling:
    """`sampling`, else the genai_config.json `search` defaults, else greedy."""
    if sampling is not None:
        return sampling
    return GREEDY if tokenizer.genai is None else Sampling.from_search(search_defaults(tokenizer))


def search_defaults(tokenizer: Tokenizer) -> dict[str, Any]:
    """genai_config.json's `search` section, the sampling defaults of a text request (each
    option a request sets overrides its own), checked as a request reads it ({} without a
    genai_config.json); ConfigError naming the file when it is not usable."""
    genai = tokenizer.genai
    if genai is None:
        return {}
    try:
        Sampling.from_search(genai.search)
    except ConfigError as error:
        raise ConfigError(f"{str(genai.path)!r}: its search section is not usable ({error}); "
                          "fix the config") from error
    return dict(genai.search)


class EngineTokens:
    """Where a text request's tokens come from: a `Request` of the runtime's batch engine
    (`runtime.submit`), the path every single request and batch of requests takes."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._request: Request | None = None

    def room(self) -> int:
        return self.runtime.stats.capacity

    def check(self, ids: SequenceOf[int], max_new_tokens: int) -> Any:
        return self.runtime.check_request(ids, max_new_tokens)

    def ends_at(self, count: int) -> bool:
        """Whether the request's `count`-th token is the end id that ended it."""
        return self._request is not None and self._request.ends_at(count)

    def stream(self, ids: Any, max_new_tokens: int, eos: tuple[int, ...],
               sampling: Sampling) -> Generator[int, None, None]:
        request = self._request = self.runtime.submit(ids, max_new_tokens, eos_token_id=eos,
                                                      sampling=sampling, wait=True)
        try:
            yield from request.tokens()
        finally:
            request.cancel()  # a stop string or a closed stream ends it; no-op at its end

    @property
    def stats(self) -> Any:
        return None if self._request is None else self._request.stats

    @property
    def logprobs(self) -> tuple[TokenLogprobs, ...]:
        return () if self._request is None else self._request.logprobs


class TextGeneration:
    """One text request; iterate it for the text as it is produced.

    `source` gives the tokens (`EngineTokens`: the batch engine). Every check (the prompt's
    ids, max_new_tokens, the stop strings, the room left) runs at construction, before any
    work. `completion` is set once the iteration has ended. `ignore_eos`, `stop_token_ids`
    and `min_tokens` are vLLM's: the EOS ids do not end it, these ids end it too, and neither
    an end id nor a stop string ends it before `min_tokens` new tokens.
    """

    def __init__(self, source: EngineTokens, tokenizer: Tokenizer,
                 ids: SequenceOf[int], max_new_tokens: int, *, sampling: Sampling,
                 stop: str | Iterable[str] | None = None, ignore_eos: bool = False,
                 stop_token_ids: Iterable[int] = (), min_tokens: int = 0,
                 logprobs: int | None = None) -> None:
        self._stops = check_stops(stop)
        if logprobs is not None:
            sampling = replace(sampling, logprobs=logprobs)
        self._ends = end_ids(tokenizer, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)
        self._min_tokens = min_tokens
        if min_tokens and self._ends:
            sampling = replace(sampling, min_tokens=min_tokens, held_token_ids=self._ends)
        self.prompt_tokens = len(ids)
        try:
            checked = source.check(ids, max_new_tokens)
            budget, at_budget = int(max_new_tokens), "length"
        except CapacityError:
            budget = source.room() - len(ids)
            if budget < 1:
                raise
            checked, at_budget = source.check(ids, budget), "capacity"
        self.completion: Completion | None = None
        self._steps = self._run(source, tokenizer, checked, budget, at_budget, sampling)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._steps)

    def close(self) -> None:
        """Stop early (the request is cancelled; its slot keeps what it was fed)."""
        self._steps.close()

    def _run(self, source: EngineTokens, tokenizer: Tokenizer, ids: Any,
             budget: int, at_budget: str, sampling: Sampling) -> Generator[str, None, None]:
        text = TokenText(tokenizer, self._stops, ends_at=source.ends_at,
                         min_tokens=self._min_tokens)
        pieces: list[str] = []
        steps = source.stream(ids, budget, self._ends, sampling)
        try:
            for token in steps:
                piece = text.push(token)
                if piece:
                    pieces.append(piece)
                    yield piece
                if text.stopped:
                    break
        finally:
            steps.close()
        piece = text.finish()
        if piece:
            pieces.append(piece)
            yield piece
        self.completion = Completion(text="".join(pieces), tokens=tuple(text.tokens),
                                     finish_reason="stop" if text.stopped else at_budget,
                                     prompt_tokens=self.prompt_tokens, stats=source.stats,
                                     logprobs=source.logprobs[:len(text.tokens)])


def stream_text(runtime: Runtime, prompt: Prompt, max_new_tokens: int, *,
                sampling: Sampling | None = None, stop: str | Iterable[str] | None = None,
                ignore_eos: bool = False, stop_token_ids: Iterable[int] = (),
                min_tokens: int = 0, logprobs: int | None = None) -> TextGeneration:
    """Text (or messages, through the chat template) on `runtime`'s batch engine (`submit`, as
    every request), checked now and run as it is iterated: the text as it is produced, and the
    Completion as its `completion` once it ended. `sampling` defaults to genai_config.json's
    search options (see docs/text.md); `ignore_eos`, `stop_token_ids` and `min_tokens` end the
    text as vLLM's options of those names do; `logprobs`: each token's logprob and the
    `logprobs` most likely tokens' in `Completion.logprobs` (as `Sampling.logprobs`)."""
    tokenizer = tokenizer_of(runtime)
    ids = PromptEncoder(tokenizer).encode(prompt)
    return TextGeneration(EngineTokens(runtime), tokenizer, ids, max_new_tokens,
                          sampling=default_sampling(tokenizer, sampling), stop=stop,
                          ignore_eos=ignore_eos, stop_token_ids=stop_token_ids,
                          min_tokens=min_tokens, logprobs=logprobs)


def generate_text(runtime: Runtime, prompt: Prompt, max_new_tokens: int, *,
                  sampling: Sampling | None = None, stop: str | Iterable[str] | None = None,
                  ignore_eos: bool = False, stop_token_ids: Iterable[int] = (),
                  min_tokens: int = 0, logprobs: int | None = None) -> Completion:
    """`stream_text` run to its end: its Completion."""
    generation = stream_text(runtime, prompt, max_new_tokens, sampling=sampling, stop=stop,
                             ignore_eos=ignore_eos, stop_token_ids=stop_token_ids,
                             min_tokens=min_tokens, logprobs=logprobs)
    for _ in generation:
        pass
    assert generation.completion is not None  # set when the iteration ended
    return generation.completion
