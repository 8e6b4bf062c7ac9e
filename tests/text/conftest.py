"""Text fixtures: small tokenizers trained here, saved beside a reference decoder.

The reference decoders carry no tokenizer, so these tests train a byte-level BPE (GPT-2 style)
and a SentencePiece-style metaspace BPE on a corpus with multi-byte UTF-8 text, and write
`tokenizer.json` and a `tokenizer_config.json` with a ChatML chat template.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

# The reference decoder the text tests run: tiny, with a vocabulary a BPE can fill.
VOCAB_SIZE = 512
# Special tokens first, so their ids are those of the reference decoder's genai_config
# (pad 0, bos 1, eos 2).
SPECIAL_TOKENS = ["<|pad|>", "<s>", "<|im_end|>", "<|im_start|>"]

CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Chunked prefill feeds a long prompt to the decoder in pieces.",
    "Les élèves étudient à l'école; où est la bibliothèque? Ça va très bien.",
    "Größe, Straße, Übung, Käse und Brötchen.",
    "日本語のテキストも含めます。東京は大きな都市です。",
    "中文文本：你好，世界。我们今天学习分词。",
    "Ελληνικά: καλημέρα κόσμε.",
    "Emoji: 🙂 🚀 🎉 👍🏽 and symbols ∑ ∫ √ ≤ ≥ €.",
    "Русский текст: привет, как дела?",
    "def main():\n    print('indented code')\n\treturn 0\n",
]


def corpus(repeats: int = 30) -> list[str]:
    return [f"{line} {index}" for index in range(repeats) for line in CORPUS]


def train_byte_level(vocab_size: int = VOCAB_SIZE):
    """A GPT-2 style byte-level BPE whose post-processor adds <s> (as Llama 3's does)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tokenizer


def train_metaspace(vocab_size: int = 600):
    """A SentencePiece-style BPE: metaspace pre-tokenizer and decoder ("▁" for spaces)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", *SPECIAL_TOKENS],
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    return tokenizer


def tokenizer_config(chat_template: object = CHATML, **extra) -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
            "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
            "clean_up_tokenization_spaces": False, "chat_template": chat_template, **extra}


def write_tokenizer(folder: Path, tokenizer=None, config: dict | None = None) -> Path:
    """Save a tokenizer (default: the byte-level one) and its config into `folder`."""
    (tokenizer or train_byte_level()).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config() if config is None else config, ensure_ascii=False))
    return folder


@pytest.fixture(scope="session")
def byte_level_tokenizer():
    return train_byte_level()


@pytest.fixture(scope="session")
def text_model(reference_model, tmp_path_factory, byte_level_tokenizer):
    """A tiny reference decoder (vocabulary 512) with a trained tokenizer beside it: the
    model.onnx path. Tests must not modify its folder; copy it first."""
    source = reference_model("base", vocab_size=VOCAB_SIZE).parent
    folder = tmp_path_factory.mktemp("text-model") / "model"
    shutil.copytree(source, folder)
    write_tokenizer(folder, byte_level_tokenizer)
    return folder / "model.onnx"


@pytest.fixture(scope="session")
def text_runtime(text_model):
    from onnx_chunk.runtime import load

    return load(text_model, provider="cpu", capacity=512, chunk_size=32)



def run_worker(peer_python: Path, worker: Path, *args: str) -> object:
    """Run a worker script in the peer venv; its JSON output."""
    result = subprocess.run([str(peer_python), str(worker), *args], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "TRANSFORMERS_VERBOSITY":
                                                         "error", "NO_COLOR": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)

