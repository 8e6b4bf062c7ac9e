"""The batch engine's rules, as pure functions and a queue: who waits, who runs, what runs next.

Chunked prefill interleaved with batched decode (as Sarathi-Serve and vLLM schedule it): every
step runs some prefill chunks of the prompts being admitted, under a token budget, then one
decode forward of every running sequence. A long prompt therefore enters one budget per step,
and the running decodes wait at most one budget's prefill forwards per token, never a whole
prompt.

Rules:
1. Waiting requests form one FIFO queue of bounded length; a submit to a full queue is a
   QueueFullError, never a silent drop or a wait (`RequestQueue`).
2. A free slot takes the request at the head of the queue (`admit`): first come, first served.
   Nothing is preempted: a slot is freed only by its request finishing, failing or being
   cancelled, and a request freed so gives its slot to the next one at the next step.
3. Per step, prefill chunks run in admission order while the rows they add stay within the
   budget; the first pending chunk always runs, so a chunk wider than the budget still makes
   progress; the first chunk that does not fit ends the step's prefill, and nothing later
   skips ahead of it (`prefill_picks`).
4. A prompt is fed in the chunks a lone sequence feeds it in (`prefill_chunks`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Generic, TypeVar

from onnx_chunk.errors import ConfigError, QueueFullError

T = TypeVar("T")


class RequestQueue(Generic[T]):
    """A bounded FIFO of waiting requests (rule 1); not thread-safe (the engine locks it)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ConfigError(f"the request queue must hold at least 1 request, got {limit}")
        self.limit = limit
        self._items: collections.deque[T] = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        return len(self._items) >= self.limit

    def push(self, item: T) -> None:
        """Queue `item` at the tail; QueueFullError when `limit` requests already wait."""
        if self.full:
            raise QueueFullError(
                f"the engine's queue is full: {self.limit} requests wait for a slot; retry "
                "later, or load the model with a larger max_queue or max_batch")
        self._items.append(item)

    def push_front(self, item: T) -> None:
        """Queue `item` at the head, past the limit: a request already accepted (a choice of
        a group that found no free slot to fork into)."""
        self._items.appendleft(item)

    def pop(self) -> T:
        """The request at the head."""
        return self._items.popleft()

    def remove(self, item: T) -> bool:
        """Take `item` out of the queue (a cancel); whether it was there."""
        try:
            self._items.remove(item)
        except ValueError:
            return False
        return True

    def drain(self) -> list[T]:
        """Every waiting request, the queue left empty."""
        items = list(self._items)
        self._items.clear()
        return items


def admit(free_slots: Sequence[int], waiting: int) -> list[int]:
    """The slots that take a waiting request now, smallest first (rule 2)."""
    return sorted(free_slots)[:max(0, waiting)]


def prefill_picks(pending: Sequence[Sequence[int]], budget: int) -> list[int]:
    """How many of each pending prompt's next chunks run this step (rule 3).

    `pending[i]` lists the row counts of prompt i's remaining chunks, prompts in admission
    order; the result has one count per prompt.
    """
    if budget < 1:
        raise ConfigError(f"the prefill token budget must be at least 1 row, got {budget}")
    picks = [0] * len(pending)
    used = 0
    for index, chunks in enumerate(pending):
        for rows in chunks:
            if used and used + rows > budget:
                return picks
            picks[index] += 1
            used += rows
    return picks


def prefill_chunks(length: int, width: int) -> list[tuple[int, int]]:
    """The [begin, end) row ranges a prompt of `length` tokens is fed in, at chunk width `width`.

    Rules:
    1. Chunks of `width` rows; the last one takes the remainder.
    2. A remainder of one row after a full chunk borrows a row from it (..., width - 1, 2): a
       one-row forward runs ONNX Runtime's single-row CPU kernels, which sum in another order
       (its logits differ from the whole-prompt forward's by ~1e-6), while forwards of two or
       more rows give the whole-prompt forward's logits bit for bit.
    """
    if length < 1 or width < 1:
        raise ConfigError(f"a prefill needs at least one token and a chunk width of at least 1, "
                          f"got {length} tokens at width {width}")
    bounds = [(begin, min(begin + width, length)) for begin in range(0, length, width)]
    if width > 2 and len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        begin, end = bounds[-2]
        bounds[-2:] = [(begin, end - 1), (end - 1, length)]
    return bounds
