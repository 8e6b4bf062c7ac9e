"""Prefix reuse: which free slot an arriving request takes, and how much of the KV it holds
is reused (the scheduler's rule 5).

Rules:
1. A free slot keeps the ids whose KV (and state) it holds from its last request
   (`KeptPrefix`): the prompt, then the generated tokens up to its length; in exact mode
   (`PrefixRule.exact`) only its request's prompt ids, whose KV prompt forwards computed (a
   generated token's row was computed by a one-row decode forward, which ONNX Runtime's
   kernels round differently from the same row in a prompt forward).
2. An arriving request takes the free slot whose kept ids share the longest usable prefix
   with its prompt (`choose_slot`); usable means at most the prompt's length less two (the
   prompt's last two ids are always fed, so its first token comes from a forward of two rows
   or more, which computes them as the whole prompt's forward did, where one row alone would
   run ONNX Runtime's one-row kernels, docs/row_grouping.md) and a prefix the slot's KV can be
   rewound to (`PrefixRule`: a window-sized cache only where its eviction rule allows,
   recurrent state only the whole kept prefix).
3. Ties, and no usable prefix anywhere, go to an empty slot first, then to the least recently
   used one, then to the smallest number: a hot prefix is never overwritten while a colder
   slot is free.
4. A prefix is shared only between requests of the same cache salt (`Sampling.cache_salt`,
   None included).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnx_chunk.errors import ConfigError
from onnx_chunk.runtime.engine.kv_window import rewind_is_exact

# The ids of a prompt a reuse always leaves to feed (rule 2).
LEFT_TO_FEED = 2


@dataclass(frozen=True)
class KeptPrefix:
    """What a free slot keeps from its last request: the ids whose KV (and state) it holds,
    in the order they were fed, `last_used`, when its last request was admitted (larger:
    more recent), and `salt`, that request's cache salt."""

    tokens: np.ndarray
    last_used: int = 0
    salt: str | None = None


@dataclass(frozen=True)
class PrefixRule:
    """Which prefixes of a slot's kept ids its buffers can be rewound to (rule 2).

    `windows`: (rows, window) of every window-sized KV cache; `recurrent`: whether the decoder
    carries recurrent (conv or SSM) state, which holds no history; `enabled`: False reuses
    nothing (every request starts on an empty slot); `exact`: exact mode's rule (rule 1).
    """

    windows: tuple[tuple[int, int], ...] = ()
    recurrent: bool = False
    enabled: bool = True
    exact: bool = False

    def kept(self, prompt: int, length: int) -> int:
        """How many leading ids of a slot holding `length` positions, whose request's prompt
        had `prompt` ids, it keeps for a later request: all, or in exact mode the prompt's."""
        return min(prompt, length) if self.exact else length

    def usable(self, kept: int, shared: int) -> int:
        """The longest prefix of at most `shared` ids of a slot holding `kept` ids that its
        buffers can be rewound to exactly (0: none; starting empty is always possible)."""
        shared = min(shared, kept)
        if not self.enabled or shared < 1:
            return 0
        if self.recurrent:
            # The state is that of all `kept` ids: only the whole kept prefix is exact.
            return kept if shared == kept else 0
        for length in range(shared, 0, -1):
            if all(rewind_is_exact(kept, kept - length, rows, window)
                   for rows, window in self.windows):
                return length
        return 0


@dataclass(frozen=True)
class SlotChoice:
    """The slot an arriving request takes and the kept ids it reuses; `shared`: the longest
    prefix any free slot's kept ids shared with the prompt (more than `reused` when the rule
    allowed less)."""

    slot: int
    reused: int
    shared: int


def shared_prefix(kept: np.ndarray, prompt: np.ndarray) -> int:
    """How many leading ids `kept` and `prompt` have in common."""
    length = min(len(kept), len(prompt))
    differ = np.flatnonzero(np.asarray(kept[:length]) != np.asarray(prompt[:length]))
    return int(differ[0]) if differ.size else length


def choose_slot(free: dict[int, KeptPrefix], prompt: np.ndarray, rule: PrefixRule,
                salt: str | None = None) -> SlotChoice:
    """The free slot (numbered keys of `free`) an arriving `prompt` of cache salt `salt`
    takes (rule 2)."""
    if not free:
        raise ConfigError("a request can only be admitted to a free slot, and none is free")
    choices = []
    longest = 0
    for slot, kept in free.items():
        shared = (shared_prefix(kept.tokens, prompt[:max(len(prompt) - LEFT_TO_FEED, 0)])
                  if rule.enabled and kept.salt == salt else 0)
        longest = max(longest, shared)
        reused = rule.usable(len(kept.tokens), shared)
        empty = len(kept.tokens) == 0
        choices.append(((-reused, not empty, 0 if empty else kept.last_used, slot),
                         slot, reused))
    _, slot, reused = min(choices)
    return SlotChoice(slot, reused, longest)
