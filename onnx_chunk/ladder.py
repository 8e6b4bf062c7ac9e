"""The query-axis ladder: a small, fixed set of prefill widths that remainder chunks round up to.

A per-shape variant cache only stops thrashing when the set of
query widths it sees is bounded and fits under its cap. With a cap of K variants, one slot is kept
for the single-row decode shape and the other K - 1 become equally spaced prefill tiers whose top
tier is exactly the chunk width W (the step is rounded up, so no stray fourth width appears just
above the last tier). W = 512 with a cap of 4 gives 171, 342, 512.

The trade-off, in the seed's own figures (a 30B INT4 decoder): with three tiers a forward runs at
most 170 extra rows; a power-of-two ladder would send 311 rows to 512 (65% more arithmetic) and
turned a 200-word prompt from 4.9 s into 7.0 s; eight tiers do not fit under a cap of 4 and
thrash (~888 recompiles per forward on the second pass), and raising the cap to 10 to hold them
drove device memory to 72.8 GB and failed a 5.5k-token prompt that the cap-4, three-tier
configuration served at a flat ~50 GB.
"""

from __future__ import annotations

from collections.abc import Sequence

from onnx_chunk.errors import ConfigError

DECODE_WIDTH = 1


def ladder_tiers(chunk_size: int, max_variants: int) -> tuple[int, ...]:
    """The prefill tiers for chunk width `chunk_size` under a cap of `max_variants` variants.

    Rules:
    1. `steps = max_variants - 1` tiers (one variant is kept for the decode shape).
    2. `step = ceil(chunk_size / steps)`; tier i is `min(i * step, chunk_size)`.
    3. Tiers strictly increase and the top tier is exactly `chunk_size`; when the chunk is
       narrower than `steps`, duplicate tiers collapse, so fewer tiers come back.
    """
    if chunk_size < 1:
        raise ConfigError(f"chunk size must be at least 1, got {chunk_size}")
    if max_variants < 2:
        raise ConfigError(
            f"max variants must be at least 2 (one prefill tier plus the decode shape), "
            f"got {max_variants}"
        )
    steps = max_variants - 1
    step = -(-chunk_size // steps)
    tiers: list[int] = []
    for i in range(1, steps + 1):
        tier = min(i * step, chunk_size)
        if not tiers or tier > tiers[-1]:
            tiers.append(tier)
    return tuple(tiers)


def padded_width(rows: int, tiers: Sequence[int], room: int | None = None) -> int:
    """The query width a forward of `rows` real rows runs at.

    Rules:
    1. One row runs at the decode width, unpadded.
    2. Otherwise the smallest tier >= rows, provided it fits in `room` (the positions left
       before the KV capacity; None means unbounded).
    3. No tier fits (rows above the top tier, or too close to capacity): the exact width.
    """
    if rows < 1:
        raise ConfigError(f"a forward needs at least one row, got {rows}")
    if rows == DECODE_WIDTH:
        return DECODE_WIDTH
    for tier in tiers:
        if tier >= rows:
            # Tiers increase, so when the smallest tier that holds the rows does not fit,
            # no larger one does either.
            return tier if room is None or tier <= room else rows
    return rows
