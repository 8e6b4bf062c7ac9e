"""Alignment to whole chunks and the up-front checks of L, c and C."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from onnx_chunk.errors import CapacityError, ConfigError, InputError
from onnx_chunk.static.alignment import (
    PadSide,
    StaticLimits,
    align_prompt,
    pad_rows,
    suggest_capacity,
)


def test_suggested_capacity_leaves_room_for_every_new_token():
    assert suggest_capacity(1216, 256) == 1472
    limits = StaticLimits(1216, 64, suggest_capacity(1216, 256))
    assert limits.decode_room == 256
    with pytest.raises(ConfigError):
        suggest_capacity(0, 8)


@pytest.mark.parametrize(
    ("max_input_len", "chunk_size", "capacity", "words"),
    [
        (32, 8, 24, ["C=24", "L=32", "C >= L"]),
        (32, 8, 32, ["no room", "L + max_new_tokens"]),
        (30, 8, 40, ["not a multiple", "L=24", "L=32"]),
        (4, 8, 40, ["not a multiple", "L=8"]),
        (8, 16, 12, ["c=16", "C=12"]),
        (0, 8, 16, ["at least 1"]),
    ],
)
def test_impossible_sizes_are_refused_with_what_to_do(max_input_len, chunk_size, capacity, words):
    with pytest.raises(ConfigError) as error:
        StaticLimits(max_input_len, chunk_size, capacity)
    for word in words:
        assert word in str(error.value)


def test_short_prompt_is_left_padded_to_whole_chunks():
    aligned = align_prompt([5, 6, 7, 8, 9], StaticLimits(16, 4, 24), pad_id=0)
    assert aligned.input_ids.tolist() == [0, 0, 0, 5, 6, 7, 8, 9]
    assert aligned.valid.tolist() == [False] * 3 + [True] * 5
    assert aligned.position_ids.tolist() == [0, 0, 0, 0, 1, 2, 3, 4]
    assert (aligned.pad_count, aligned.truncated_count, aligned.aligned_len) == (3, 0, 8)


def test_right_padding_repeats_the_last_token_and_continues_the_positions():
    aligned = align_prompt([5, 6, 7, 8, 9], StaticLimits(16, 4, 24), pad_side=PadSide.RIGHT)
    assert aligned.input_ids.tolist() == [5, 6, 7, 8, 9, 9, 9, 9]
    assert aligned.valid.tolist() == [True] * 5 + [False] * 3
    assert aligned.position_ids.tolist() == list(range(8))
    assert (aligned.pad_count, aligned.kept_len, aligned.aligned_len) == (3, 5, 8)
    truncated = align_prompt(list(range(20)), StaticLimits(16, 4, 24), pad_side=PadSide.RIGHT)
    assert truncated.input_ids.tolist() == list(range(4, 20)) and truncated.valid.all()


def test_long_prompt_is_left_truncated_with_a_warning(caplog):
    prompt = list(range(10, 30))
    with caplog.at_level(logging.WARNING, logger="onnx_chunk.static.alignment"):
        aligned = align_prompt(prompt, StaticLimits(16, 4, 24))
    assert aligned.input_ids.tolist() == prompt[4:]
    assert aligned.truncated_count == 4 and aligned.pad_count == 0
    assert aligned.position_ids.tolist() == list(range(16))
    assert "20 tokens" in caplog.text and "first 4 tokens" in caplog.text


def test_strict_mode_refuses_truncation():
    with pytest.raises(CapacityError, match="drops its first 1 tokens"):
        align_prompt(list(range(17)), StaticLimits(16, 4, 24), strict=True)
    assert align_prompt(list(range(16)), StaticLimits(16, 4, 24), strict=True).aligned_len == 16


def test_empty_prompt_is_an_input_error():
    with pytest.raises(InputError):
        align_prompt([], StaticLimits(16, 4, 24))


@given(prompt_len=st.integers(1, 200), chunk=st.integers(1, 16), chunks=st.integers(1, 8),
       room=st.integers(1, 32))
def test_alignment_rules_hold_for_any_sizes(prompt_len, chunk, chunks, room):
    limits = StaticLimits(chunk * chunks, chunk, chunk * chunks + room)
    prompt = np.arange(1, prompt_len + 1)
    aligned = align_prompt(prompt, limits, pad_id=0)
    assert aligned.aligned_len % chunk == 0
    assert aligned.aligned_len <= limits.max_input_len
    assert aligned.pad_count < chunk
    kept = aligned.input_ids[aligned.valid]
    assert kept.tolist() == prompt[aligned.truncated_count:].tolist()
    assert aligned.truncated_count == max(0, prompt_len - limits.max_input_len)
    assert aligned.position_ids[aligned.valid].tolist() == list(range(len(kept)))
    assert not aligned.valid[:aligned.pad_count].any()


def test_padded_rows_go_on_the_layouts_side():
    left = pad_rows(np.array([5, 6]), 0, 4, PadSide.LEFT, pad_id=1)
    assert left.input_ids.tolist() == [1, 1, 5, 6] and left.position_ids.tolist() == [0, 0, 0, 1]
    assert left.valid.tolist() == [False, False, True, True] and left.pad_count == 2
    right = pad_rows(np.array([5, 6]), 7, 4, PadSide.RIGHT, pad_id=1)
    assert right.input_ids.tolist() == [5, 6, 6, 6] and right.position_ids.tolist() == [7, 8, 9, 10]
    assert right.valid.tolist() == [True, True, False, False] and right.pad_count == 2
    full = pad_rows(np.array([5]), 9, 1, PadSide.LEFT, pad_id=1)
    assert (full.input_ids.tolist(), full.position_ids.tolist(), full.pad_count) == ([5], [9], 0)
    for ids in (np.array([], dtype=np.int64), np.arange(5)):
        with pytest.raises(ConfigError, match="expected 1 to 4"):
            pad_rows(ids, 0, 4, PadSide.RIGHT, pad_id=0)


@given(prompt_len=st.integers(1, 200), chunk=st.integers(1, 16), chunks=st.integers(1, 8),
       side=st.sampled_from(PadSide))
def test_each_chunk_of_an_aligned_prompt_is_its_real_rows_padded(prompt_len, chunk, chunks, side):
    # What the static runner feeds a forward (a chunk's real rows at the real positions seen so
    # far), padded back, is that chunk of the aligned prompt; the pads add up to pad_count.
    limits = StaticLimits(chunk * chunks, chunk, chunk * chunks + 1)
    aligned = align_prompt(np.arange(1, prompt_len + 1), limits, pad_id=0, pad_side=side)
    fed = pads = 0
    for start in range(0, aligned.aligned_len, chunk):
        window = slice(start, start + chunk)
        real = aligned.input_ids[window][aligned.valid[window]]
        padded = pad_rows(real, fed, chunk, side, pad_id=0)
        assert padded.input_ids.tolist() == aligned.input_ids[window].tolist()
        assert padded.valid.tolist() == aligned.valid[window].tolist()
        assert padded.position_ids.tolist() == aligned.position_ids[window].tolist()
        fed, pads = fed + len(real), pads + padded.pad_count
    assert (fed, pads) == (aligned.kept_len, aligned.pad_count)
