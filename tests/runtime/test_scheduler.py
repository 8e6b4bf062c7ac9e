"""The batch engine's pure rules: the bounded FIFO queue, admission, the prefill budget, the
decode mask and which idle rows a window-sized cache must be protected for."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from onnx_chunk.errors import ConfigError, QueueFullError
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for
from onnx_chunk.runtime.engine.kv_window import rewind_is_exact
from onnx_chunk.runtime.engine.prefix_reuse import (
    KeptPrefix,
    PrefixRule,
    choose_slot,
    shared_prefix,
)
from onnx_chunk.runtime.engine.request_queue import RequestQueue
from onnx_chunk.runtime.engine.scheduler import batch_pays, prefill_picks
from onnx_chunk.runtime.runner.attention_mask import decode_mask, mask_kind
from onnx_chunk.runtime.runner.idle_rows import evicting_rows


def test_the_queue_is_fifo_bounded_and_says_when_it_is_full():
    queue = RequestQueue(2)
    queue.push("a")
    queue.push("b")
    assert queue.full and len(queue) == 2
    with pytest.raises(QueueFullError, match="2 requests wait"):
        queue.push("c")
    assert queue.pop() == "a"
    queue.push("c")
    assert queue.remove("c") and not queue.remove("c")
    assert queue.drain() == ["b"] and len(queue) == 0
    with pytest.raises(ConfigError):
        RequestQueue(0)


def _kept(ids, last_used=0):
    return KeptPrefix(np.asarray(ids, dtype=np.int64), last_used)


def test_a_request_takes_the_free_slot_with_the_longest_shared_prefix():
    prompt = np.array([1, 2, 3, 4, 5])
    free = {0: _kept([1, 2, 9], 1), 1: _kept([1, 2, 3, 4], 2), 2: _kept([])}
    choice = choose_slot(free, prompt, PrefixRule())
    assert (choice.slot, choice.reused, choice.shared) == (1, 3, 3)
    # Two prompt ids are always left to feed: the same prompt again reuses all but its last two.
    assert choose_slot({0: _kept([1, 2, 3, 4, 5, 6])}, prompt, PrefixRule()).reused == 3
    assert choose_slot({0: _kept([7, 8])}, np.array([7]), PrefixRule()).reused == 0


def test_no_shared_prefix_takes_an_empty_slot_then_the_least_recently_used():
    prompt = np.array([5, 6, 7])
    assert choose_slot({0: _kept([1], 3), 2: _kept([]), 1: _kept([])}, prompt,
                       PrefixRule()).slot == 1
    assert choose_slot({0: _kept([1], 3), 1: _kept([2], 1), 2: _kept([3], 2)}, prompt,
                       PrefixRule()).slot == 1
    # Equal reuse: the least recently used of them.
    assert choose_slot({0: _kept([5, 6], 3), 1: _kept([5, 6], 1)}, prompt,
                       PrefixRule()).slot == 1
    # Reuse off: nothing is reused, and an empty slot (the smallest) comes first.
    choice = choose_slot({0: _kept([5, 6], 3), 1: _kept([]), 3: _kept([])}, prompt,
                         PrefixRule(enabled=False))
    assert (choice.slot, choice.reused, choice.shared) == (1, 0, 0)


def test_recurrent_state_reuses_only_the_whole_kept_prefix():
    rule = PrefixRule(recurrent=True)
    prompt = np.array([1, 2, 3, 4, 5])
    assert choose_slot({0: _kept([1, 2, 3])}, prompt, rule).reused == 3
    # A prompt that leaves the kept ids partway cannot roll the state back: nothing reused.
    choice = choose_slot({0: _kept([1, 2, 3, 9]), 1: _kept([])}, prompt, rule)
    assert (choice.slot, choice.reused, choice.shared) == (1, 0, 3)
    # The same prompt again: its state is kept one id too far.
    assert choose_slot({0: _kept([1, 2, 3, 4, 5])}, prompt, rule).reused == 0


def test_a_window_cache_reuses_only_what_its_evictions_left_exact():
    # 12 rows for a window of 8: 5 positions are reclaimed per eviction.
    rule = PrefixRule(windows=((12, 8),))
    kept = list(range(20))
    # At 20 positions it has evicted twice; a rewind to 19 or 18 stays in the same eviction.
    assert rule.usable(20, 20) == 20 and rule.usable(20, 19) == 19
    assert not rewind_is_exact(20, 20 - 17, 12, 8)
    prompt = np.array(kept[:17] + [99, 98])
    choice = choose_slot({0: _kept(kept)}, prompt, rule)
    assert choice.reused < choice.shared == 17
    assert choice.reused == 0 or rewind_is_exact(20, 20 - choice.reused, 12, 8)


def _usable_by_brute_force(kept, prompt, rule):
    best = 0
    for length in range(0, min(len(kept), len(prompt) - 2) + 1):
        if list(kept[:length]) != list(prompt[:length]) or length == 0:
            continue
        if rule.recurrent and length != len(kept):
            continue
        if all(rewind_is_exact(len(kept), len(kept) - length, rows, window)
               for rows, window in rule.windows):
            best = length
    return best if rule.enabled else 0


_ids = st.lists(st.integers(0, 2), max_size=24)


@given(st.dictionaries(st.integers(0, 7), st.tuples(_ids, st.integers(0, 20)), min_size=1,
                       max_size=5),
       st.lists(st.integers(0, 2), min_size=1, max_size=24),
       st.sampled_from([PrefixRule(), PrefixRule(recurrent=True), PrefixRule(enabled=False),
                        PrefixRule(windows=((12, 8),)), PrefixRule(windows=((9, 4), (16, 16)))]))
def test_the_chosen_slot_reuses_the_longest_exact_prefix_there_is(slots, prompt, rule):
    free = {slot: _kept(ids, used) for slot, (ids, used) in slots.items()}
    prompt = np.array(prompt)
    choice = choose_slot(free, prompt, rule)
    kept = free[choice.slot].tokens
    usable = {slot: _usable_by_brute_force(kept_prefix.tokens, prompt, rule)
              for slot, kept_prefix in free.items()}
    # The longest usable prefix of any free slot, and a true prefix of both.
    assert choice.reused == max(usable.values()) == usable[choice.slot]
    assert choice.reused <= max(len(prompt) - 2, 0)
    assert list(kept[:choice.reused]) == list(prompt[:choice.reused])
    assert choice.shared >= choice.reused
    if rule.enabled:
        assert choice.shared == max(shared_prefix(kept_prefix.tokens, prompt[:-2])
                                    for kept_prefix in free.values())
    # Ties (and no reuse at all): an empty slot first, then the least recently used.
    tied = [slot for slot, length in usable.items() if length == choice.reused]
    empty = sorted(slot for slot in tied if len(free[slot].tokens) == 0)
    if empty:
        assert choice.slot == empty[0]
    else:
        oldest = min(free[slot].last_used for slot in tied)
        assert free[choice.slot].last_used == oldest


def test_with_no_decode_waiting_every_prompt_runs_its_next_chunk():
    assert prefill_picks([[16, 16], [16], [], [3]], 16, decoding=False) == [1, 1, 0, 1]
    assert prefill_picks([[16, 16], [16], [3]], 16) == [1, 0, 0]


def test_a_round_runs_batched_only_where_it_computes_no_more_rows():
    assert batch_pays([128, 128, 128, 128], 4)
    assert not batch_pays([128, 128, 128, 43], 4)  # 512 rows for 427 alone
    assert batch_pays([128, 128], 2) and not batch_pays([128, 128], 3)
    assert not batch_pays([128], 1)  # one chunk runs alone


def test_prefill_fills_the_budget_in_admission_order_and_never_skips_ahead():
    # Short prompts share one step's budget.
    assert prefill_picks([[5], [4], [6]], 16) == [1, 1, 1]
    # The first chunk that does not fit ends the step: the 3-row prompt behind it waits.
    assert prefill_picks([[5], [16], [3]], 16) == [1, 0, 0]
    # Several chunks of one prompt in one step.
    assert prefill_picks([[4, 4, 4, 4, 1]], 16) == [4]
    # A chunk wider than the budget still runs (the first one always does).
    assert prefill_picks([[32], [1]], 16) == [1, 0]
    assert prefill_picks([], 16) == []
    with pytest.raises(ConfigError):
        prefill_picks([[1]], 0)


@given(st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=4), max_size=6),
       st.integers(1, 64))
def test_prefill_picks_stay_within_the_budget_and_make_progress(pending, budget):
    picks = prefill_picks(pending, budget)
    rows = sum(sum(chunks[:count]) for chunks, count in zip(pending, picks))
    if pending:
        assert picks[0] >= 1
        assert rows <= max(budget, pending[0][0])
    # FIFO: a prompt gets chunks only if every earlier one got all of its chunks.
    for index, count in enumerate(picks):
        if count:
            assert all(picks[before] == len(pending[before]) for before in range(index))


def test_the_decode_mask_gives_each_row_its_own_length_plus_one():
    mask = decode_mask([0, 3, 1], 5, np.int64)
    assert mask.tolist() == [[1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    device = device_for("cpu")
    assert mask_kind(MaskPolicy.LOGICAL)(3, 64, np.int64, device).width([0, 3, 1]) == 4
    assert mask_kind(MaskPolicy.CAPACITY)(3, 64, np.int64, device).width([0, 3, 1]) == 64


def test_idle_rows_are_protected_only_where_one_more_position_would_evict():
    lengths = [47, 48, 10, 0]
    assert evicting_rows(lengths, [0, 1, 2, 3], rows=48, window=32) == [1]
    assert evicting_rows(lengths, [0, 2], rows=48, window=32) == []
    assert evicting_rows(lengths, [1], rows=48, window=None) == []
