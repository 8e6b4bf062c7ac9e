"""The batch engine's rules, as pure functions and a queue: who waits, who runs, what runs next.

Chunked prefill interleaved with batched decode (as Sarathi-Serve and vLLM schedule it): every
step runs some prefill chunks of the prompts being admitted, under a token budget, then one
decode forward of every running sequence. A long prompt therefore enters one budget per step,
and the running decodes wait at most one budget's prefill forwards per token, never a whole
prompt.

Rules:
1. Waiting requests form one FIFO queue of bounded length; a submit to a full queue is a
   QueueFullError, never a silent drop or a wait (`RequestQueue`).
2. A free slot takes the request at the head of the queue: first come, first served (which
   free slot: rule 5).
   Nothing is preempted: a slot is freed only by its request finishing, failing or being
   cancelled, and a request freed so gives its slot to the next one at the next step.
3. Per step, prefill chunks run in admission order while the rows they add stay within the
   budget; the first pending chunk always runs, so a chunk wider than the budget still makes
   progress; the first chunk that does not fit ends the step's prefill, and nothing later
   skips ahead of it (`prefill_picks`).
4. A prompt is fed in the chunks a lone sequence feeds it in (`prefill_chunks`).
5. Prefix reuse (`choose_slot`): a free slot keeps the ids whose KV it holds from its last
   request (`KeptPrefix`). An arriving request takes the free slot whose kept ids share the
   longest usable prefix with its prompt; usable means at most the prompt's length less one
   (one token is always fed, so the first token comes from a forward) and a prefix the slot's
   KV can be rewound to (`PrefixRule`: a window-sized cache only where its eviction rule
   allows, recurrent state only the whole kept prefix). Ties, and no usable prefix anywhere,
   go to an empty slot first, then to the least recently used one, then to the smallest
   number: a hot prefix is never overwritten while a colder slot is free. A prefix is shared
   only between requests of the same cache salt (`Sampling.cache_salt`, None included).
   In exact mode (`PrefixRule.exact`) a slot keeps only its request's prompt ids, whose KV
   prompt forwards computed (a generated token's row was computed by a one-row decode
   forward, which ONNX Runtime's kernels round differently from the same row in a prompt
   forward), and a reuse leaves at least two ids to feed, so that no prompt forward after a
   past has one row (docs/row_grouping.md).
6. With native chunks (GroupQueryAttention's query_seqlens) the chunks of one round (each
   prompt's next picked chunk) run in one forward [slots, S] over the engine's buffers (idle
   slots at query_seqlens 0, S the widest chunk's width) when that computes no more rows
   than the chunks would alone (`batch_pays`: slots * S <= the sum of their own widths);
   else one forward each. A step in which no row decodes stalls no decode, so every
   prefilling prompt's next chunk runs (`prefill_picks` with `decoding=False`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from onnx_chunk.errors import ConfigError, QueueFullError
from onnx_chunk.runtime.engine.kv_window import rewind_is_exact

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


def prefill_picks(pending: Sequence[Sequence[int]], budget: int, *,
                  decoding: bool = True) -> list[int]:
    """How many of each pending prompt's next chunks run this step (rule 3; with
    `decoding=False`, no row decoding and chunks batched natively, rule 6: one each).

    `pending[i]` lists the row counts of prompt i's remaining chunks, prompts in admission
    order; the result has one count per prompt.
    """
    if budget < 1:
        raise ConfigError(f"the prefill token budget must be at least 1 row, got {budget}")
    if not decoding:
        return [1 if chunks else 0 for chunks in pending]
    picks = [0] * len(pending)
    used = 0
    for index, chunks in enumerate(pending):
        for rows in chunks:
            if used and used + rows > budget:
                return picks
            picks[index] += 1
            used += rows
    return picks


def batch_pays(widths: Sequence[int], slots: int) -> bool:
    """Whether one round's chunks, of these (padded) widths, run in one forward of `slots`
    rows (rule 6): at least two chunks, and slots * the widest no more rows than their sum."""
    return len(widths) >= 2 and slots * max(widths) <= sum(widths)


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
    """Which prefixes of a slot's kept ids its buffers can be rewound to (rule 5).

    `windows`: (rows, window) of every window-sized KV cache; `recurrent`: whether the decoder
    carries recurrent (conv or SSM) state, which holds no history; `enabled`: False reuses
    nothing (every request starts on an empty slot); `exact`: exact mode's rule (rule 5).
    """

    windows: tuple[tuple[int, int], ...] = ()
    recurrent: bool = False
    enabled: bool = True
    exact: bool = False

    @property
    def left_to_feed(self) -> int:
        """The ids of a prompt a reuse always leaves to feed (rule 5)."""
        return 2 if self.exact else 1

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
    takes (rule 5)."""
    if not free:
        raise ConfigError("a request can only be admitted to a free slot, and none is free")
    choices = []
    longest = 0
    for slot, kept in free.items():
        # One prompt id (two in exact mode) is always left to feed.
        shared = (shared_prefix(kept.tokens, prompt[:max(len(prompt) - rule.left_to_feed, 0)])
                  if rule.enabled and kept.salt == salt else 0)
        longest = max(longest, shared)
        reused = rule.usable(len(kept.tokens), shared)
        empty = len(kept.tokens) == 0
        choices.append(((-reused, not empty, 0 if empty else kept.last_used, slot),
                         slot, reused))
    _, slot, reused = min(choices)
    return SlotChoice(slot, reused, longest)
