"""What a forward is and what runs one: `Forward` (rows over one slot), `Ran` (what it gave)
and `ForwardRunner`, the interface every forward goes through.

`ModelRunner` (a dynamic decoder, `Slot`) and the static runner's graphs (`onnx_chunk.static.
runner`, a static request's slot) are the two forward runners: a caller builds a `Forward` of
the real rows it feeds and reads the logits asked for, the width the forward ran at and the
padded rows the runner added to reach it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol, TypeVar

import numpy as np

from onnx_chunk.runtime.runner.slot import Length

LogitsRows = Literal["none", "last", "all"]


@dataclass
class Row:
    """One batch row of a forward: the ids it feeds from its logical length.

    `steps=False`: an idle row (a free slot, a prompt between prefill chunks), run at its own
    length and left as it was.
    """

    tokens: np.ndarray
    length: Length
    steps: bool = True


@dataclass
class Forward:
    """One forward: a row per batch row of the slot, and which logits rows come back."""

    rows: list[Row]
    logits: LogitsRows = "last"

    @property
    def width(self) -> int:
        """The real query rows each batch row feeds."""
        return len(self.rows[0].tokens)


class Ran(NamedTuple):
    """What a forward gave: the logits asked for, its query width and its padded rows.

    `logits`: "last": [batch, vocab]; "all": [batch, rows, vocab]; "none": None.
    """

    logits: np.ndarray | None
    width: int
    padded_rows: int


SlotT_contra = TypeVar("SlotT_contra", contravariant=True)


class ForwardRunner(Protocol[SlotT_contra]):
    """Runs forwards on slots of one kind: the real rows in, `Ran` out.

    A runner may widen the rows (ladder tiers, a static graph's fixed rows); `Ran.padded_rows`
    counts what it added, and each stepping row's length advances by its real rows only.
    """

    def run(self, slot: SlotT_contra, forward: Forward) -> Ran: ...
