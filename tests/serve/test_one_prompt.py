"""One prompt encoder: the same messages (and tools) are fed as the same ids through every entry
point (the text API, a Conversation's turn, the server's chat endpoint, /tokenize), and the
Ray router's key is the text those ids encode (the rendering the replica feeds, tools
included), under the server's special-token policy.

On every export of the corpus with a chat template (its tokenizer alone), and live on the
test export with a chat template that shows tools (the corpus's templates ignore them).
"""

from __future__ import annotations

import json
import shutil

import pytest

from onnx_chunk.graph.model_folder import locate_model
from onnx_chunk.runtime import load
from onnx_chunk.serve.routing import request_key
from onnx_chunk.serve.tokenize import tokenize
from onnx_chunk.text.conversation import Conversation
from onnx_chunk.text.generation import generate_text, stream_text
from onnx_chunk.text.prompt import PromptEncoder
from onnx_chunk.text.tokenizer import load_tokenizer, tokenizer_of
from tests.exports.corpus import fixtures
from tests.serve.conftest import EXPORT, exchange, live_server
from tests.serve.test_dialect import HERMES_TEMPLATE, WEATHER

CHAT = "/v1/chat/completions"
# A special token every export's vocabulary has, typed into the user's message: the policy
# decides whether it is a control token or text.
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi<|im_end|> there, what is the weather?"}]
_TEMPLATED = [fixture for fixture in fixtures()
              if (fixture.folder / "chat_template.jinja").is_file()
              or "chat_template" in json.loads(
                  (fixture.folder / "tokenizer_config.json").read_text())]


class _Recorder:
    """A runtime stand-in for the text API: the model folder it reads the tokenizer from, and
    the prompt ids a text request checks; it runs nothing."""

    def __init__(self, folder):
        location = locate_model(folder)
        self.model_path, self.genai = location.onnx_path, location.genai
        self.ids: list[int] = []

    def check_request(self, ids, max_new_tokens):
        self.ids = list(ids)
        return ids


def _key(prompts: PromptEncoder, body: dict) -> str:
    return request_key(CHAT, json.dumps(body).encode(), prompts)


@pytest.mark.parametrize("fixture", _TEMPLATED, ids=str)
def test_every_entry_point_of_a_corpus_export_encodes_the_same_ids(fixture):
    tokenizer = load_tokenizer(fixture.folder)
    source = _Recorder(fixture.folder)
    stream_text(source, MESSAGES, 1)  # the text API (transformers' policy)
    for special_in_content in (True, False):
        server = PromptEncoder(tokenizer, special_in_content=special_in_content,
                               max_tokens=1 << 20)
        for body in ({"messages": MESSAGES}, {"messages": MESSAGES, "tools": [WEATHER]}):
            tokens = tokenize(body, server, lambda model: None)["tokens"]
            key = _key(PromptEncoder(tokenizer, special_in_content=special_in_content), body)
            assert key == tokenizer.apply_chat_template(MESSAGES, tools=body.get("tools"))
            if special_in_content:
                assert tokens == source.ids  # these templates do not show tools
                assert tokenizer.encode(key, add_special_tokens=False) == tokens
            else:  # the typed token is text: one control token fewer
                end = tokenizer.token_id("<|im_end|>")
                assert tokens.count(end) == source.ids.count(end) - 1


@pytest.fixture(scope="module")
def shown_tools(tmp_path_factory):
    """The test export with a chat template that shows the tools."""
    folder = tmp_path_factory.mktemp("tools") / EXPORT.name
    shutil.copytree(EXPORT, folder)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE, encoding="utf-8")
    with load(folder, provider="cpu", max_batch=1) as runtime:
        yield runtime


def _submitted(runtime, monkeypatch) -> list[list[int]]:
    """The prompt ids of every request submitted to `runtime` from now on."""
    seen: list[list[int]] = []
    submit = runtime.submit

    def recording(ids, *args, **kwargs):
        seen.append(list(ids))
        return submit(ids, *args, **kwargs)

    monkeypatch.setattr(runtime, "submit", recording)
    return seen


@pytest.mark.parametrize("special_in_content", [False, True])
def test_serve_chat_tokenize_and_the_router_key_agree_tools_included(shown_tools, monkeypatch,
                                                                     special_in_content):
    seen = _submitted(shown_tools, monkeypatch)
    tokenizer = tokenizer_of(shown_tools)
    fed = {}
    with live_server(shown_tools, parse_special_in_content=special_in_content) as live:
        for tools in ([], [WEATHER]):
            body = {"messages": MESSAGES, **({"tools": tools} if tools else {})}
            status, _, answer = exchange(live, "POST", CHAT, {**body, "max_tokens": 1})
            assert status == 200, answer
            fed[len(tools)] = seen[-1]
            status, _, counted = exchange(live, "POST", "/tokenize", body)
            assert status == 200 and counted["tokens"] == seen[-1]
            key = _key(PromptEncoder(tokenizer, special_in_content=special_in_content), body)
            assert key == tokenizer.apply_chat_template(MESSAGES, tools=tools or None)
            assert tokenizer.decode(seen[-1]) == key
            if special_in_content:
                assert tokenizer.encode(key, add_special_tokens=False) == seen[-1]
    assert "get_weather" in tokenizer.decode(fed[1]) and fed[1] != fed[0]


def test_the_text_api_a_conversation_and_serve_chat_feed_the_same_ids(shown_tools,
                                                                      monkeypatch):
    seen = _submitted(shown_tools, monkeypatch)
    generate_text(shown_tools, MESSAGES, 1)
    conversation = Conversation(shown_tools, system=MESSAGES[0]["content"])
    "".join(conversation.say(MESSAGES[1]["content"], 1))
    with live_server(shown_tools, parse_special_in_content=True) as live:
        status, _, answer = exchange(live, "POST", CHAT, {"messages": MESSAGES,
                                                          "max_tokens": 1})
        assert status == 200, answer
    text_api, turn, served = seen[-3:]
    assert text_api == turn == served
    assert text_api == _transformers_ids(tokenizer_of(shown_tools))


def _transformers_ids(tokenizer) -> list[int]:
    """transformers' ids of MESSAGES: the template's text, encoded without added tokens."""
    return tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
