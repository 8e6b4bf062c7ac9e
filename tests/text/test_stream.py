"""Incremental detokenization: the stream adds up to the full decode, never a broken character."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnx_chunk.text.stream import REPLACEMENT, TextStream
from tests.text.conftest import CORPUS, train_metaspace


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    return train_metaspace()


def _streamed(tokenizer, ids, skip_special_tokens):
    stream = TextStream(lambda tokens: tokenizer.decode(list(tokens),
                                                        skip_special_tokens=skip_special_tokens))
    pieces = [stream.push(token) for token in ids]
    return pieces + [stream.finish()]


_SETTINGS = settings(max_examples=150, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_any_token_sequence_streams_to_its_decode(byte_level_tokenizer, metaspace_tokenizer,
                                                  data, skip):
    for tokenizer in (byte_level_tokenizer, metaspace_tokenizer):
        ids = data.draw(st.lists(st.integers(0, tokenizer.get_vocab_size() - 1), max_size=40))
        pieces = _streamed(tokenizer, ids, skip)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)


_TEXT = st.text(alphabet=st.sampled_from(sorted(set("".join(CORPUS)) | {" ", "\n", "é", "🙂"})),
                min_size=1, max_size=60)


@_SETTINGS
@given(text=_TEXT)
def test_real_text_streams_without_a_broken_character(byte_level_tokenizer, metaspace_tokenizer,
                                                      text):
    for tokenizer in (byte_level_tokenizer, metaspace_tokenizer):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        pieces = _streamed(tokenizer, ids, True)
        expected = tokenizer.decode(ids)
        assert "".join(pieces) == expected
        if REPLACEMENT not in expected:
            assert not any(REPLACEMENT in piece for piece in pieces), pieces


def test_a_character_split_across_byte_level_tokens_comes_whole(byte_level_tokenizer):
    ids = byte_level_tokenizer.encode("日本語", add_special_tokens=False).ids
    # The trained merges split these three-byte characters across tokens.
    assert any(REPLACEMENT in byte_level_tokenizer.decode([token]) for token in ids)
    pieces = _streamed(byte_level_tokenizer, ids, True)
    assert "".join(pieces) == "日本語"
    assert all(REPLACEMENT not in piece for piece in pieces)
    assert "" in pieces  # a token that ended mid-character was held


def test_metaspace_words_keep_their_leading_space_but_the_first(metaspace_tokenizer):
    ids = metaspace_tokenizer.encode("Hello world again").ids
    pieces = [piece for piece in _streamed(metaspace_tokenizer, ids, True) if piece]
    assert "".join(pieces) == "Hello world again"
    assert pieces[0].startswith("H") and any(piece.startswith(" ") for piece in pieces[1:])
