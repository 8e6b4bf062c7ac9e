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


def test_an_eos_id_ends_the_text_and_is_counted_not_shown(tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    eos = tokenizer.eos_token_ids[0]
    text = TokenText(tokenizer)
    assert _feed(text, [*ids, eos, *ids]) == tokenizer.decode(ids, skip_special_tokens=True)
    assert text.stopped and text.tokens == [*ids, eos]


def test_a_stop_string_ends_the_text_before_it(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    text = TokenText(tokenizer, stop=["three"])
    shown = _feed(text, ids)
    assert shown == "one two " and text.stopped
    assert len(text.tokens) < len(ids)
