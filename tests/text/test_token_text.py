"""TokenText: generated ids to the text a client sees, wherever the ids come from."""

from __future__ import annotations

import pytest

from onnx_chunk.text.token_text import TokenText
from onnx_chunk.text.tokenizer import load_tokenizer
from tests.exports.corpus import ROOT


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ROOT / "genai-qwen3-fp32")


def _feed(text: TokenText, ids: list[int]) -> str:
    pieces = []
    for token in ids:
        pieces.append(text.push(token))
        if text.stopped:
            break
    return "".join(pieces) + text.finish()


def test_the_pieces_add_up_to_the_decode_of_every_id(tokenizer):
    ids = tokenizer.encode("Hello, world! ça va? 日本語 🙂", add_special_tokens=False)
    text = TokenText(tokenizer)
    assert _feed(text, ids) == tokenizer.decode(ids, skip_special_tokens=True)
    assert text.tokens == ids and not text.stopped


def test_the_end_id_that_ended_the_request_ends_the_text_counted_not_shown(tokenizer):
    """The engine's finish rule says which id ended the request (`Request.ends_at`); the text
    ends there, that id counted and its text not shown, whatever the id is (an EOS id or a
    request's stop_token_ids, whose text a tokenizer would show)."""
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    shown = tokenizer.encode(" again", add_special_tokens=False)[0]
    text = TokenText(tokenizer, ends_at=lambda count: count == len(ids) + 1)
    assert _feed(text, [*ids, shown, *ids]) == tokenizer.decode(ids, skip_special_tokens=True)
    assert text.stopped and text.tokens == [*ids, shown]


def test_an_id_the_finish_rule_did_not_end_at_is_text(tokenizer):
    """An EOS id that did not end the request (`ignore_eos`) is no end of the text."""
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    eos = tokenizer.eos_token_ids[0]
    text = TokenText(tokenizer)
    assert _feed(text, [*ids, eos, *ids]) == tokenizer.decode([*ids, eos, *ids],
                                                             skip_special_tokens=True)
    assert not text.stopped and text.tokens == [*ids, eos, *ids]


def test_a_stop_string_ends_the_text_before_it(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    text = TokenText(tokenizer, stop=["three"])
    shown = _feed(text, ids)
    assert shown == "one two " and text.stopped
    assert len(text.tokens) < len(ids)
