"""Text in and out on the real exports, live against transformers and onnxruntime-genai.

On every builder export: `encode` equals genai's `Tokenizer.encode` and transformers'; greedy
`generate --prompt` text equals genai's decoding of genai's own greedy tokens for the same
text; the chat-template rendering equals transformers' `apply_chat_template(tokenize=False)`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from onnx_chunk.cli import main
from onnx_chunk.runtime import load
from onnx_chunk.text.tokenizer import tokenizer_of
from tests.exports.corpus import builder_gqa_fixtures

WORKER = Path(__file__).with_name("peer_text_worker.py")
NEW_TOKENS = 12
PROMPT = "The capital of France is"
TEXTS = ["Hello, world!", "  leading spaces, accents: ça va, déjà vu", "日本語のテキスト 🙂🚀",
         "<|im_start|>user\nhi<|im_end|>", "tabs\tand\nnewlines\n\n", ""]
CHATS = [
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Hi — ça va? 日本語 🙂"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
                  {"role": "user", "content": "three"}],
     "add_generation_prompt": False},
]


@pytest.fixture(scope="module")
def peers(peer_python):
    answers = {}

    def answer(fixture):
        if fixture.name not in answers:
            request = {"folder": str(fixture.folder), "texts": TEXTS, "chats": CHATS,
                       "prompt": PROMPT, "new_tokens": NEW_TOKENS,
                       "max_length": load(fixture.folder, provider="cpu").stats.capacity}
            done = subprocess.run([str(peer_python), str(WORKER), json.dumps(request)],
                                  capture_output=True, text=True, timeout=300, check=False)
            assert done.returncode == 0, done.stderr[-3000:]
            answers[fixture.name] = json.loads(done.stdout)
        return answers[fixture.name]

    return answer


@pytest.fixture(params=builder_gqa_fixtures(), ids=str)
def export(request):
    return request.param


def test_encode_equals_genai_and_transformers(export, peers):
    tokenizer = tokenizer_of(load(export.folder, provider="cpu"))
    ours = [tokenizer.encode(text) for text in TEXTS]
    assert ours == peers(export)["transformers"]["texts"]
    assert ours == peers(export)["genai"]["texts"]


def test_the_chat_template_renders_as_transformers_renders_it(export, peers):
    tokenizer = tokenizer_of(load(export.folder, provider="cpu"))
    theirs = peers(export)["transformers"]["chats"]
    if tokenizer.chat_template is None:
        assert theirs == [], "transformers found a template onnx-chunk did not"
        return
    ours = [tokenizer.apply_chat_template(chat["messages"],
                                          add_generation_prompt=chat["add_generation_prompt"])
            for chat in CHATS]
    assert ours == theirs


def test_greedy_text_equals_genais_decoding_of_its_own_tokens(export, peers, capsys):
    """genai's tokens, decoded as transformers decodes them. genai's own Tokenizer.decode stops
    at the first byte sequence that is not UTF-8 (random weights emit such bytes), so its text
    is a prefix of ours up to that point."""
    genai = peers(export)["genai"]
    capsys.readouterr()
    code = main(["generate", str(export.folder), "--prompt", PROMPT, "--max-new-tokens",
                 str(NEW_TOKENS), "--provider", "cpu", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    completion = json.loads(out)
    assert completion["tokens"] == genai["tokens"]
    assert completion["text"] == peers(export)["transformers"]["decoded"]
    assert completion["text"].startswith(genai["text"].rstrip("\ufffd"))
