"""A sequence's logical length beside its fixed-capacity KV buffers.

The KV buffers are allocated once at capacity and never move; what a sequence holds is the
logical length: how many leading positions of those buffers are valid. GQA learns it from the
attention mask (`onnx_chunk.runtime.runner.attention_mask`), so the mask is the only input that
changes when the length does. Rewinding is moving the length back: the entries past it are
overwritten by the next forward.
"""

from __future__ import annotations

from typing import Protocol

from onnx_chunk.errors import CapacityError, ConfigError, InputError
from onnx_chunk.runtime.runner.slot import Length


class RowLength(Length, Protocol):
    """What the engine uses of a request's length: the runner's `Length`, and `rewind` after a
    verification (`LogicalLength`; a static request's `onnx_chunk.static.graphs.StaticLength`)."""

    def rewind(self, count: int) -> None: ...


class LogicalLength:
    """The logical length of one sequence and its capacity."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"the KV capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.length = 0

    @property
    def room(self) -> int:
        """Positions left before the capacity."""
        return self.capacity - self.length

    def check_room(self, rows: int, what: str = "the request") -> None:
        """CapacityError, with the numbers, when `rows` more positions do not fit."""
        if rows > self.room and self.length == 0:
            raise CapacityError(
                f"{what} needs {rows} positions, more than the KV capacity {self.capacity}; "
                "shorten it or load the model with a larger capacity")
        if rows > self.room:
            raise CapacityError(
                f"{what} needs {rows} positions but the sequence holds {self.length} of its "
                f"{self.capacity}-position KV capacity ({self.room} left); shorten it, rewind "
                "the sequence or load the model with a larger capacity")

    def end(self, width: int) -> int:
        """Where a forward of `width` query rows at the current length ends (its mask width)."""
        end = self.length + width
        if end > self.capacity:
            raise CapacityError(f"a forward of {width} rows at length {self.length} ends at "
                                f"{end}, past the KV capacity {self.capacity}")
        return end

    def advance(self, rows: int) -> None:
        """Make `rows` more positions valid (after a forward wrote them)."""
        if rows < 0 or rows > self.room:
            raise CapacityError(f"cannot advance length {self.length} by {rows} within the "
                                f"capacity {self.capacity}")
        self.length += rows

    def rewind(self, count: int) -> None:
        """Drop the last `count` positions; the next forward overwrites them."""
        if count < 0 or count > self.length:
            raise InputError(f"cannot rewind {count} positions of a sequence of length "
                             f"{self.length}; expected 0 to {self.length}")
        self.length -= count
