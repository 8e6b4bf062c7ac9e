"""vLLM's text fields below the server: stop strings kept, special tokens shown (and joined),
the end token's text kept, a chat template's variables, and a final message continued."""

from __future__ import annotations

import json

import pytest

from onnx_chunk.errors import InputError
from onnx_chunk.text.chat_template import ChatTemplate, ContinuationError
from onnx_chunk.text.prompt import ChatOptions, PromptEncoder
from onnx_chunk.text.stops import StopMatcher
from onnx_chunk.text.token_text import TokenText
from onnx_chunk.text.tokenizer import Tokenizer
from tests.text.conftest import tokenizer_config, write_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_kept_stop_string_ends_the_text_after_it_and_nothing_is_held():
    matcher = StopMatcher(["XYZ"], include=True)
    assert [matcher.feed(piece) for piece in ("ab", "cX", "YZd")] == ["ab", "cX", "YZ"]
    assert matcher.stopped and matcher.feed("more") == ""
    held = StopMatcher(["XYZ"])
    assert [held.feed(piece) for piece in ("ab", "cX", "YZd")] == ["ab", "c", ""]


def test_the_earliest_ending_kept_stop_string_wins():
    matcher = StopMatcher(["long stop", "st"], include=True)
    assert matcher.feed("a long stop") == "a long st"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, byte_level_tokenizer):
    return Tokenizer.load(write_tokenizer(tmp_path_factory.mktemp("tok"), byte_level_tokenizer))


def _text(tokenizer, ids, end_at=None, **options) -> str:
    text = TokenText(tokenizer, ends_at=lambda count: count == end_at, **options)
    pieces = [text.push(token) for token in ids]
    return "".join(pieces) + text.finish()


def test_special_tokens_and_the_end_tokens_text_on_request(tokenizer):
    end = tokenizer.token_id("<|im_end|>")
    ids = [*tokenizer.encode("Hello", add_special_tokens=False), end]
    assert _text(tokenizer, ids, end_at=len(ids)) == "Hello"
    assert _text(tokenizer, ids, end_at=len(ids), skip_special_tokens=False) == "Hello"
    assert _text(tokenizer, ids, end_at=len(ids), skip_special_tokens=False,
                 include_stop_str_in_output=True) == "Hello<|im_end|>"
    shown = [tokenizer.token_id("<|im_start|>"), *ids[:-1]]
    assert _text(tokenizer, shown, skip_special_tokens=False) == "<|im_start|>Hello"
    assert _text(tokenizer, shown) == "Hello"


def test_added_tokens_in_a_row_lose_the_space_a_decoder_puts_between_them(tmp_path):
    """A WordPiece decoder joins tokens with spaces; vLLM's fast detokenizer shows an added
    token that follows another as its own text when spaces_between_special_tokens is false."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    backend = Backend(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(["<x>", "<y>"])
    folder = tmp_path / "wordpiece"
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(None)))
    loaded = Tokenizer.load(folder)
    x, y = loaded.token_id("<x>"), loaded.token_id("<y>")
    assert loaded.decode([x, y]) == "<x> <y>"
    assert _text(loaded, [x, y], skip_special_tokens=False) == "<x> <y>"
    assert _text(loaded, [x, y], skip_special_tokens=False,
                 spaces_between_special_tokens=False) == "<x><y>"
    assert _text(loaded, [0, x, 1], skip_special_tokens=False,
                 spaces_between_special_tokens=False) == "a <x> b"


def _template(source: str) -> ChatTemplate:
    return ChatTemplate(source, {"bos_token": "<s>"}, "a test")


def test_variables_reach_the_template_and_may_override_a_special_token():
    template = _template("{{ bos_token }}{% if enable_thinking is false %}no-think{% endif %}")
    assert template.render(MESSAGES) == "<s>"
    assert template.render(MESSAGES, variables={"enable_thinking": False}) == "<s>no-think"
    assert template.render(MESSAGES, variables={"bos_token": "[B]"}) == "[B]"
    for name in ("messages", "add_generation_prompt", "raise_exception", "namespace"):
        with pytest.raises(InputError, match=name):
            template.render(MESSAGES, variables={name: 1})


def test_a_continued_final_message_ends_the_rendering_after_its_content():
    chatml = _template("{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}<|end|>"
                       "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    messages = [*MESSAGES, {"role": "assistant", "content": "Paris is "}]
    assert chatml.render(messages, continue_final_message=True) == \
        "<|user|>hi<|end|><|assistant|>Paris is"
    kept = _template("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert kept.render(messages, continue_final_message=True) == "[hi][Paris is "
    with pytest.raises(InputError, match="do not go together"):
        chatml.render(messages, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ContinuationError, match="does not write"):
        _template("{% for m in messages %}x{% endfor %}").render(
            messages, continue_final_message=True)


def test_a_callers_template_compiles_in_the_same_sandbox(tokenizer):
    template = tokenizer.compile_template("{{ bos_token }}{{ messages[0].content }}", "mine")
    encoder = PromptEncoder(tokenizer)
    ids = encoder.encode(MESSAGES, chat=ChatOptions(template=template))
    assert ids == tokenizer.encode("<s>hi", add_special_tokens=False)
    with pytest.raises(InputError, match="does not compile"):
        tokenizer.compile_template("{% if %}", "mine")


def test_keep_last_feeds_the_last_ids_of_a_prompt_too_long_for_the_context(tokenizer):
    encoder = PromptEncoder(tokenizer, max_tokens=8)
    text = "The quick brown fox jumps over the lazy dog. " * 20
    with pytest.raises(Exception, match="more than 8 tokens"):
        encoder.encode(text)
    whole = tokenizer.encode(text)
    assert encoder.encode(text, keep_last=5) == whole[-5:]
