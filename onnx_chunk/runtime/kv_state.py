"""A sequence's logical length beside its fixed-capacity KV buffers, and the mask it implies.

The KV buffers are allocated once at capacity and never move; what a sequence holds is the
logical length: how many leading positions of those buffers are valid. GQA learns it from the
attention mask (`seqlens_k = sum(mask) - 1`, `total_sequence_length = mask width`), so the mask
is the only thing that changes when the length does. Rewinding is moving the length back: the
entries past it are overwritten by the next forward.

Two mask width policies (chosen per provider, see `onnx_chunk.runtime.provider`):
1. logical: a forward of `rows` rows at length `n` binds the first `n + rows` columns of an
   all-ones buffer (a view, nothing is written per step);
2. capacity: the whole capacity-wide buffer is bound, ones for the first `n + rows` columns
   and zeros after; only the columns that change are written, here and (through `changed`)
   in the device copy: one element per decode step.
"""

from __future__ import annotations

import numpy as np

from onnx_chunk.errors import CapacityError, ConfigError, InputError
from onnx_chunk.runtime.provider import MaskPolicy


class LogicalLength:
    """The logical length of one sequence, its capacity and the attention-mask buffer."""

    def __init__(self, capacity: int, policy: MaskPolicy) -> None:
        if capacity < 1:
            raise ConfigError(f"the KV capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.policy = MaskPolicy(policy)
        self.length = 0
        if self.policy is MaskPolicy.LOGICAL:
            self._mask = np.ones((1, capacity), dtype=np.int64)
        else:
            self._mask = np.zeros((1, capacity), dtype=np.int64)
        self._ones = capacity if self.policy is MaskPolicy.LOGICAL else 0
        # The columns the last `mask_for` changed, [start, stop): what a device copy of the
        # mask needs to be sent (capacity policy; always empty under the logical one).
        self.changed = (0, 0)

    @property
    def room(self) -> int:
        """Positions left before the capacity."""
        return self.capacity - self.length

    def check_room(self, rows: int, what: str = "the request") -> None:
        """CapacityError, with the numbers, when `rows` more positions do not fit."""
        if rows > self.room:
            raise CapacityError(
                f"{what} needs {rows} positions but the sequence holds {self.length} of its "
                f"{self.capacity}-position KV capacity ({self.room} left); shorten it, rewind "
                "the sequence or load the model with a larger capacity")

    def mask_for(self, width: int) -> np.ndarray:
        """The attention mask for a forward of `width` query rows at the current length."""
        end = self.length + width
        if end > self.capacity:
            raise CapacityError(f"a forward of {width} rows at length {self.length} ends at "
                                f"{end}, past the KV capacity {self.capacity}")
        if self.policy is MaskPolicy.LOGICAL:
            return self._mask[:, :end]
        if end > self._ones:
            self._mask[0, self._ones:end] = 1
        elif end < self._ones:
            self._mask[0, end:self._ones] = 0
        self.changed = (min(end, self._ones), max(end, self._ones))
        self._ones = end
        return self._mask

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
