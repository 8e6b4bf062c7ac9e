"""Stop strings: cut where the earliest completes, held back while they might still begin."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onnx_chunk.errors import InputError
from onnx_chunk.text.stops import StopMatcher, check_stops


def _run(stops, pieces):
    matcher = StopMatcher(stops)
    emitted = []
    for piece in pieces:
        emitted.append(matcher.feed(piece))
        if matcher.stopped:
            break
    else:
        emitted.append(matcher.flush())
    return emitted, matcher.stopped


def test_a_stop_spanning_pieces_is_cut_with_what_follows():
    emitted, stopped = _run(["</answer>"], ["The answer is 4", "2.</an", "swer> and more"])
    assert stopped and "".join(emitted) == "The answer is 42."
    # "</an" might begin the stop string: it was not emitted before it was settled.
    assert emitted[1] == "2."


def test_held_text_that_is_no_stop_comes_out():
    emitted, stopped = _run(["STOP"], ["go ST", "ART now", " S"])
    assert not stopped and emitted == ["go ", "START now", " ", "S"]


def test_the_earliest_of_several_stops_wins():
    emitted, stopped = _run(["cd", "bcde"], ["abcdef"])
    assert stopped and emitted == ["a"]
    emitted, stopped = _run(["cd", "bcde"], ["ab", "cd", "ef"])
    assert stopped and "".join(emitted) == "ab"


@given(text=st.text(alphabet="abc", max_size=30), stops=st.lists(
    st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=6))
def test_pieces_emit_what_one_pass_over_the_whole_text_would(text, stops, cuts):
    bounds = sorted({0, len(text), *(min(cut, len(text)) for cut in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    # The matcher looks after each piece, as a server looks after each token (vLLM's rule):
    # at the end of the first piece in which some stop string is complete, the text is cut
    # where the earliest of the stop strings complete by then begins.
    expected, found = text, False
    for end in bounds[1:]:
        starts = [index for index in (text[:end].find(stop) for stop in stops) if index >= 0]
        if starts:
            expected, found = text[:min(starts)], True
            break
    emitted, stopped = _run(stops, pieces)
    joined = "".join(emitted)
    assert joined == expected and stopped == found
    assert all(stop not in joined for stop in stops)


@pytest.mark.parametrize("stop, message", [([""], "non-empty"), ([3], "non-empty string"),
                                           (["ok", None], "non-empty")])
def test_bad_stops(stop, message):
    with pytest.raises(InputError, match=message):
        check_stops(stop)


def test_one_string_is_one_stop():
    assert check_stops("ab") == ("ab",) and check_stops(None) == ()
