import pytest
from hypothesis import given
from hypothesis import strategies as st

from onnx_chunk.errors import ConfigError
from onnx_chunk.ladder import DECODE_WIDTH, ladder_tiers, padded_width


def test_seed_example():
    assert ladder_tiers(512, 4) == (171, 342, 512)


@pytest.mark.parametrize("rows,expected", [(1, 1), (2, 171), (113, 171), (171, 171), (172, 342),
                                           (176, 342), (311, 342), (343, 512), (512, 512)])
def test_seed_widths(rows, expected):
    assert padded_width(rows, ladder_tiers(512, 4)) == expected


@given(st.integers(1, 4096), st.integers(2, 12))
def test_ladder_properties(chunk_size, max_variants):
    tiers = ladder_tiers(chunk_size, max_variants)
    steps = max_variants - 1
    step = -(-chunk_size // steps)
    assert tiers[-1] == chunk_size
    assert all(a < b for a, b in zip(tiers, tiers[1:]))
    assert len(tiers) <= steps
    # Together with the decode shape the ladder fits under the cap.
    assert len(set(tiers) | {DECODE_WIDTH}) <= max_variants
    for rows in range(1, chunk_size + 1):
        width = padded_width(rows, tiers)
        if rows == 1:
            assert width == DECODE_WIDTH
            continue
        assert width == min(t for t in tiers if t >= rows)
        assert 0 <= width - rows < step


@given(st.integers(2, 1024), st.integers(2, 8), st.data())
def test_padding_never_passes_room(chunk_size, max_variants, data):
    tiers = ladder_tiers(chunk_size, max_variants)
    rows = data.draw(st.integers(1, chunk_size))
    room = data.draw(st.integers(rows, chunk_size + 8))
    width = padded_width(rows, tiers, room)
    assert rows <= width <= room
    assert width == rows or width in tiers


def test_exact_width_when_no_tier_fits():
    tiers = ladder_tiers(512, 4)
    assert padded_width(200, tiers, room=300) == 200
    assert padded_width(200, tiers, room=342) == 342
    assert padded_width(600, tiers) == 600


@pytest.mark.parametrize("chunk_size,max_variants", [(0, 4), (512, 1), (-3, 4)])
def test_bad_parameters(chunk_size, max_variants):
    with pytest.raises(ConfigError):
        ladder_tiers(chunk_size, max_variants)


def test_bad_rows():
    with pytest.raises(ConfigError):
        padded_width(0, (171, 342, 512))
