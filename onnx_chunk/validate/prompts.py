"""Prompt lengths around the chunk boundaries, and seeded random prompts to run at them."""

from __future__ import annotations

import numpy as np

from onnx_chunk.errors import ConfigError


def boundary_lengths(chunk_size: int, longest: int) -> tuple[int, ...]:
    """Prompt lengths that exercise every way a prompt meets the chunk boundaries.

    Rules:
    1. For chunk width W: 1 (a single row), W - 1, W, W + 1 (a remainder of one row) and
       2W + W // 3 + 1 (two full chunks and a partial one), when at least 1.
    2. Lengths above `longest` (what capacity and new tokens leave room for) are dropped;
       `longest` itself is added when that dropped any, so the longest case still runs.
    3. Ascending, without duplicates.
    """
    if chunk_size < 1:
        raise ConfigError(f"the chunk size must be at least 1, got {chunk_size}")
    if longest < 1:
        raise ConfigError(f"no prompt fits: the longest prompt would be {longest} tokens; raise "
                          "the capacity or generate fewer new tokens")
    wanted = {1, chunk_size - 1, chunk_size, chunk_size + 1,
              2 * chunk_size + chunk_size // 3 + 1}
    lengths = {length for length in wanted if 1 <= length <= longest}
    if len(lengths) < len({length for length in wanted if length >= 1}):
        lengths.add(longest)
    return tuple(sorted(lengths))


def seeded_prompt(vocab_size: int, length: int, seed: int) -> np.ndarray:
    """`length` token ids drawn uniformly from [0, vocab_size), reproducible per (seed, length)."""
    rng = np.random.default_rng([seed, length])
    return rng.integers(0, vocab_size, size=length, dtype=np.int64)
