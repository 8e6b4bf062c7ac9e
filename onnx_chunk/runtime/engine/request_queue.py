"""The engine's waiting requests: one bounded FIFO queue (the scheduler's rule 1).

A submit to a full queue is a QueueFullError, never a silent drop or a wait; a request already
accepted (another choice of a prompt that found no free slot) goes back at the head.
"""

from __future__ import annotations

import collections
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
