"""A generation request submitted to the batch engine: its tokens as they come, its end.

`Runtime.submit` returns a `Request` at once; the engine's thread fills it. Any thread may
read it: `tokens()` yields the tokens as they are produced, `result()` waits for the end and
returns them all, `cancel()` ends it (its slot is freed before the engine's next step). A
reader that must not block (an event loop) registers a callback with `watch()` and reads what
came with `ready()`.
A request ends with one `finish_reason`: "stop" (an end-of-sequence id came), "length"
(`max_new_tokens` reached), "cancelled" or "error" (a forward of its step failed, or the
runtime closed: `result()` and `tokens()` raise that exception). `finish_reason` is the one
rule for "stop" and "length", which every generation loop (the engine's, a lone sequence's)
applies after each token.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from onnx_chunk import arguments
from onnx_chunk.errors import InputError
from onnx_chunk.runtime.engine.counters import ChunkRecord
from onnx_chunk.runtime.engine.kv_state import LogicalLength
from onnx_chunk.sampling import GREEDY, Sampler, Sampling, TokenLogprobs

FinishReason = Literal["stop", "length", "cancelled", "error"]

_ids = itertools.count()


@dataclass
class RequestStats:
    """One request's timings and counts (seconds from its submit).

    `queued_s`: until a slot took it; `ttft_s`: until its first token; `total_s`: until it
    ended; `prefill_chunks`: the prefill forwards its prompt took (`chunks`: each one's real
    rows, query width and seconds); `cached_tokens`: the
    leading prompt ids whose KV its slot kept from an earlier request (prefix reuse), which
    were not fed again.
    """

    prompt_tokens: int
    new_tokens: int = 0
    prefill_chunks: int = 0
    cached_tokens: int = 0
    queued_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    chunks: tuple[ChunkRecord, ...] = ()

    @property
    def decode_tokens_per_s(self) -> float | None:
        """The tokens after the first over the time after the first (None before two)."""
        if self.ttft_s is None or self.total_s is None or self.new_tokens < 2:
            return None
        decode_s = self.total_s - self.ttft_s
        return (self.new_tokens - 1) / decode_s if decode_s > 0 else None


def finish_reason(token: int, produced: int, max_new_tokens: int,
                  eos_token_ids: tuple[int, ...]) -> FinishReason | None:
    """Why a generation ends with `token`, its `produced`-th new token (None: it goes on).

    Rules: 1. an end-of-sequence id ends it ("stop"), even as the last allowed token;
    2. else the `max_new_tokens`-th token ends it ("length"). (A request of 0 new tokens, for
    its prompt's logprobs, ends "length" after its prefill without choosing any.)
    """
    if token in eos_token_ids:
        return "stop"
    if produced >= max_new_tokens:
        return "length"
    return None


@dataclass(frozen=True)
class CheckedRequest:
    """A generation request checked once, before anything is queued or run: its prompt ids
    (int64, a copy), its new tokens, the ids it stops at, and the sampler that chooses its
    tokens. The runtime's submissions, a sequence's generations and the static runner's are
    all made by `check`."""

    prompt: np.ndarray
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    sampler: Sampler

    @classmethod
    def check(cls, prompt_ids: object, max_new_tokens: object, eos_token_id: object,
              sampling: Sampling | None, *, vocab: int, eos_default: tuple[int, ...] = (),
              room: LogicalLength | None = None,
              tokens_only: str | None = None) -> CheckedRequest:
        """The request, checked by these rules, in order:

        1. The prompt: 1-D, not empty, integer ids in [0, vocab) (`arguments.prompt_ids`).
        2. `tokens_only` (where logprobs are not given; the message says where to ask): a
           sampling that asks for logprobs or prompt logprobs is refused.
        3. max_new_tokens: an integer of at least 1, or 0 for a request of its prompt's
           logprobs alone (lm-evaluation-harness's scoring).
        4. `room`: the logical length the request continues (an empty one of the capacity for
           a request on a fresh slot) holds the prompt plus the new tokens (CapacityError
           with the numbers); None: the caller checks its own capacity.
        5. The end ids: `eos_token_id` (one id or several, each in [0, vocab)), or
           `eos_default` when it is None.
        6. The sampler of `sampling` (default greedy; ConfigError for a field out of range),
           which has seen the prompt (the repetition penalty counts its ids).
        Every failure is an InputError unless said otherwise.
        """
        ids = arguments.prompt_ids(prompt_ids, vocab)
        if tokens_only is not None and sampling is not None and (
                sampling.logprobs is not None or sampling.prompt_logprobs is not None):
            raise InputError(tokens_only)
        scoring = sampling is not None and sampling.prompt_logprobs is not None
        new_tokens = arguments.integer(max_new_tokens, "max_new_tokens",
                                       minimum=0 if scoring else 1)
        if room is not None:
            room.check_room(len(ids) + new_tokens,
                            f"a prompt of {len(ids)} tokens plus {new_tokens} new tokens")
        stop = arguments.stop_ids(eos_token_id, eos_default, vocab)
        sampler = Sampler(GREEDY if sampling is None else sampling, vocab)
        sampler.observe(ids)
        return cls(ids, new_tokens, stop, sampler)


class Request:
    """One submitted generation (see the module docstring)."""

    def __init__(self, prompt: np.ndarray, max_new_tokens: int, eos_token_ids: tuple[int, ...],
                 on_cancel: Callable[[Request], None]) -> None:
        self.id = next(_ids)
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = eos_token_ids
        self._on_cancel = on_cancel
        self._submitted = time.perf_counter()
        self._tokens: list[int] = []
        self._times: list[float] = []
        self._logprobs: list[TokenLogprobs] = []
        self._prompt_logprobs: list[TokenLogprobs | None] = []
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._error: BaseException | None = None
        self._reason: FinishReason | None = None
        self._ended_by: int | None = None  # the count of the end id that ended it
        self._stats = RequestStats(prompt_tokens=len(prompt))
        self._watchers: list[Callable[[], None]] = []

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why it ended ("stop", "length", "cancelled", "error"), None while it runs."""
        return self._reason

    @property
    def done(self) -> bool:
        return self._reason is not None

    @property
    def stats(self) -> RequestStats:
        """Its counters now (a copy)."""
        with self._lock:
            return replace(self._stats)

    @property
    def token_times(self) -> tuple[float, ...]:
        """When each token so far was produced, in seconds from the submit."""
        with self._lock:
            return tuple(self._times)

    @property
    def logprobs(self) -> tuple[TokenLogprobs, ...]:
        """The logprobs of each token so far (when its `Sampling.logprobs` asked for them;
        else empty). Token i's entry is there as soon as token i is."""
        with self._lock:
            return tuple(self._logprobs)

    @property
    def prompt_logprobs(self) -> tuple[TokenLogprobs | None, ...]:
        """Per prompt token, its logprobs (None for the first), when `Sampling.prompt_logprobs`
        asked for them; complete once the first token (or, with 0 new tokens, the end) came."""
        with self._lock:
            return tuple(self._prompt_logprobs)

    @property
    def produced(self) -> tuple[int, ...]:
        """The tokens produced so far (a copy)."""
        with self._lock:
            return tuple(self._tokens)

    def tokens(self) -> Iterator[int]:
        """The tokens as they are produced; raises the request's error after its last token."""
        for token, _ in self.steps():
            yield token

    def steps(self) -> Iterator[tuple[int, TokenLogprobs | None]]:
        """Like `tokens()`, each token with its logprobs (None when they were not asked for)."""
        seen = 0
        while True:
            with self._lock:
                while seen == len(self._tokens) and self._reason is None:
                    self._changed.wait()
                ready = self._tokens[seen:]
                logprobs = self._logprobs[seen:seen + len(ready)]
                ended = self._reason is not None
            yield from zip(ready, logprobs + [None] * (len(ready) - len(logprobs)))
            seen += len(ready)
            if ended and seen == len(self._tokens):
                if self._error is not None:
                    raise self._error
                return

    def ends_at(self, count: int) -> bool:
        """Whether its `count`-th token is the end-of-sequence id that ended it (the finish
        rule's "stop", recorded with the token: known to whoever has read that token)."""
        return self._ended_by == count

    def watch(self, callback: Callable[[], None]) -> None:
        """Call `callback()` after each token and at the end (on the engine's thread, so it
        must be quick and must not raise: `loop.call_soon_threadsafe` of a wake-up); once at
        once when the request has already ended."""
        with self._lock:
            self._watchers.append(callback)
            ended = self._reason is not None
        if ended:
            callback()

    def ready(self, seen: int) -> tuple[list[int], list[TokenLogprobs | None], bool]:
        """Without waiting: the tokens after the first `seen`, their logprobs (None where not
        asked for), and whether the request has ended; raises the request's error once its
        last token has been read."""
        with self._lock:
            tokens = self._tokens[seen:]
            logprobs: list[TokenLogprobs | None] = list(
                self._logprobs[seen:seen + len(tokens)])
            ended = self._reason is not None
            error = self._error
        if ended and not tokens and error is not None:
            raise error
        return tokens, logprobs + [None] * (len(tokens) - len(logprobs)), ended

    def since(self, seen: int) -> tuple[list[int], bool]:
        """`ready` without the logprobs: the tokens after the first `seen` and whether the
        request has ended (for a caller that steps the engine itself)."""
        with self._lock:
            tokens = self._tokens[seen:]
            ended = self._reason is not None
            error = self._error
        if ended and not tokens and error is not None:
            raise error
        return tokens, ended

    def _notify(self) -> None:
        for callback in self._watchers:
            callback()

    def result(self, timeout: float | None = None) -> list[int]:
        """Wait for the end and return every token (TimeoutError after `timeout` seconds);
        raises the request's error when it failed."""
        with self._lock:
            if not self._changed.wait_for(lambda: self._reason is not None, timeout):
                raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
            if self._error is not None:
                raise self._error
            return list(self._tokens)

    def cancel(self) -> None:
        """End the request now ("cancelled"); the tokens so far stay. No-op once it ended."""
        if self._reason is None:
            self._on_cancel(self)

    # The engine's side: only the engine thread (or a cancel) calls these.

    def admitted(self, cached_tokens: int = 0) -> None:
        with self._lock:
            self._stats.queued_s = time.perf_counter() - self._submitted
            self._stats.cached_tokens = cached_tokens

    def note_chunk(self, chunk: ChunkRecord) -> None:
        with self._lock:
            self._stats.prefill_chunks += 1
            self._stats.chunks += (chunk,)

    def add_prompt_logprobs(self, entries: list[TokenLogprobs | None]) -> None:
        """Add the logprobs of the next prompt tokens (a prefill chunk's)."""
        with self._lock:
            self._prompt_logprobs.extend(entries)

    def deliver(self, token: int, logprobs: TokenLogprobs | None = None) -> FinishReason | None:
        """Add a produced token (and its logprobs); the reason the request ends with it, if
        it does."""
        with self._lock:
            if self._reason is not None:
                return self._reason
            if logprobs is not None:
                self._logprobs.append(logprobs)
            self._tokens.append(token)
            self._times.append(time.perf_counter() - self._submitted)
            self._stats.new_tokens = len(self._tokens)
            if self._stats.ttft_s is None:
                self._stats.ttft_s = self._times[0]
            reason = finish_reason(token, len(self._tokens), self.max_new_tokens,
                                   self.eos_token_ids)
            if reason == "stop":
                self._ended_by = len(self._tokens)
            self._changed.notify_all()
        self._notify()
        return reason

    def finish(self, reason: FinishReason, error: BaseException | None = None) -> bool:
        """End the request with `reason` (and `error`); False when it had already ended."""
        with self._lock:
            if self._reason is not None:
                return False
            self._reason = reason
            self._error = error
            self._stats.total_s = time.perf_counter() - self._submitted
            self._changed.notify_all()
        self._notify()
        return True

    def __repr__(self) -> str:
        return (f"Request(id={self.id}, prompt_tokens={len(self.prompt)}, "
                f"new_tokens={len(self._tokens)}, finish_reason={self._reason!r})")
