"""Parity with transformers: rendered chat templates and encoded ids of the same folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onnx_chunk.text.chat_template import ChatTemplateError
from onnx_chunk.text.tokenizer import Tokenizer
from tests.text.conftest import CHATML, run_worker, tokenizer_config, write_tokenizer

WORKER = Path(__file__).with_name("peer_tokenizer_worker.py")

# A template that uses what transformers adds to jinja: tojson with its options, loop
# controls, the generation block, strftime_now, namespace and the special tokens by name.
FEATURES = (
    "{%- set ns = namespace(count=0) -%}"
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'skip' %}{% continue %}{% endif -%}"
    "{%- if message['role'] == 'end' %}{% break %}{% endif -%}"
    "{%- set ns.count = ns.count + 1 %}\n"
    "  [{{ ns.count }}] {{ message | tojson }} {{ message | tojson(indent=2, sort_keys=true) }}\n"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{%- endif -%}"
    "{%- endfor %}\n"
    "year {{ strftime_now('%Y') }} pad {{ pad_token }} extra {{ additional_special_tokens }}\n"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)

CHATS = [
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Hi — ça va? 日本語 🙂"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
                  {"role": "user", "content": "three\n  indented\n"}],
     "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
                  {"role": "user", "content": "<b>\"quoted\" & 'tagged'</b>"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "skip", "content": "x"},
                  {"role": "assistant", "content": "ok"}, {"role": "end", "content": "y"},
                  {"role": "user", "content": "never"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "robot", "content": "beep"}], "add_generation_prompt": True},
]

TEXTS = ["Hello, world!", "  leading spaces and 日本語", "<|im_start|>user\nhi<|im_end|>",
         "Emoji 🙂🚀 and € signs", "<s>already a bos"]


def _folder(tmp_path: Path, byte_level_tokenizer, name: str, config: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    return write_tokenizer(folder, byte_level_tokenizer, config)


def _ours(folder: Path) -> dict:
    tokenizer = Tokenizer.load(folder)
    chats = []
    for case in CHATS:
        try:
            text = tokenizer.apply_chat_template(
                case["messages"], add_generation_prompt=case["add_generation_prompt"])
        except ChatTemplateError as error:
            chats.append({"error": str(error)})
        else:
            chats.append({"text": text})
    texts = [tokenizer.encode(text) for text in TEXTS]
    return {"chats": chats, "texts": texts,
            "decoded": [tokenizer.decode(ids, skip_special_tokens=True) for ids in texts]}


FOLDERS = {
    "chatml": (tokenizer_config(), None),
    "features": (tokenizer_config(FEATURES, additional_special_tokens=["<|im_start|>"]), None),
    "named": (tokenizer_config([{"name": "tool_use", "template": "{{ 'tools' }}"},
                                {"name": "default", "template": CHATML}]), None),
    "jinja-file": (tokenizer_config("{{ 'not this one' }}"), FEATURES),
    "llama-class": (tokenizer_config(tokenizer_class="LlamaTokenizerFast", add_bos_token=True,
                                     add_eos_token=True, legacy=False), None),
    "neox-class": (tokenizer_config(tokenizer_class="GPTNeoXTokenizerFast"), None),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, byte_level_tokenizer):
    root = tmp_path_factory.mktemp("parity")
    made = {}
    for name, (config, template_file) in FOLDERS.items():
        made[name] = _folder(root, byte_level_tokenizer, name, config)
        if template_file is not None:
            (made[name] / "chat_template.jinja").write_text(template_file, encoding="utf-8")
    return made


@pytest.fixture(scope="module")
def transformers_results(folders, peer_python, tmp_path_factory):
    """transformers' renderings and ids for every folder, from one run of the worker."""
    cases = tmp_path_factory.mktemp("cases") / "cases.json"
    cases.write_text(json.dumps({"chats": CHATS, "texts": TEXTS}, ensure_ascii=False),
                     encoding="utf-8")
    results = run_worker(peer_python, WORKER, str(cases), *map(str, folders.values()))
    return dict(zip(folders, results))


@pytest.mark.parametrize("name", FOLDERS)
def test_templates_and_ids_match_transformers(folders, transformers_results, name):
    folder = folders[name]
    theirs = transformers_results[name]
    ours = _ours(folder)
    for case, mine, reference in zip(CHATS, ours["chats"], theirs["chats"]):
        if "error" in reference:
            assert "error" in mine and reference["error"] in mine["error"], (case, mine)
        else:
            assert mine == reference, case
    assert ours["texts"] == theirs["texts"]
    assert ours["decoded"] == theirs["decoded"]
    tokenizer = Tokenizer.load(folder)
    assert tokenizer.bos_token_id == theirs["bos_token_id"]
    assert tokenizer.eos_token_ids == (theirs["eos_token_id"],)


def test_the_bad_role_case_is_refused_by_both(tmp_path, byte_level_tokenizer):
    # The last chat calls raise_exception in CHATML: the parity test above compares an error.
    folder = _folder(tmp_path, byte_level_tokenizer, "chatml", tokenizer_config())
    assert "error" in _ours(folder)["chats"][-1]
