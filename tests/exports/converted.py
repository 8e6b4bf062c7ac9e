"""What tests of `onnx-chunk convert`'s weight options read off a converted folder: its prompt
logits and greedy tokens beside the source's, and its greedy tokens from onnx-chunk and from
onnxruntime-genai (the peer venv)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from onnx_chunk.runtime import load
from scripts._bench import environment
from scripts._bench.child import run_child


def greedy_tokens_both(folder: Path, peer_python: Path, new_tokens: int = 6,
                       prompt_tokens: int = 40) -> tuple[list[int], list[int]]:
    """(onnx-chunk's, genai's) greedy tokens of one seeded prompt on `folder`, each runtime
    sized to onnx-chunk's capacity, genai without chunking."""
    with load(folder, provider="cpu") as runtime:
        prompt = [(7 * index + 3) % runtime.stats.vocab_size for index in range(prompt_tokens)]
        with runtime.open_sequence() as sequence:
            ours = sequence.generate(prompt, new_tokens)
        capacity = runtime.stats.capacity
    genai = run_child(environment.worker_argv(peer_python, "genai_worker", {
        "model": str(folder), "prompts": [prompt], "new_tokens": new_tokens, "chunk_size": 0,
        "max_length": capacity}), timeout_s=300).payload["results"][0]["tokens"]
    return ours, genai


def logits_and_tokens(folder: Path, new_tokens: int = 8,
                      prompt_tokens: int = 40) -> tuple[np.ndarray, list[int]]:
    """Every row's logits of one seeded prompt and its greedy continuation on `folder` (chunks
    of 32, no end id)."""
    with load(folder, provider="cpu", chunk_size=32) as runtime:
        vocab = runtime.stats.vocab_size
        prompt = [(7 * index + 3) % vocab for index in range(prompt_tokens)]
        with runtime.open_sequence() as sequence:
            logits = sequence.prefill(prompt, all_logits=True)
        with runtime.open_sequence() as sequence:
            tokens = sequence.generate(prompt, new_tokens, eos_token_id=[])
    return logits, tokens

