"""A plain ONNX Runtime loop over an unmodified concat-KV export: each present fed back as past.

The reference the concat-KV rewrite is held to: what the export computes as its exporter meant
it (Optimum's own generate gives the same greedy tokens; docs/exports.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.models._ort import carry, run, session

PAST_PREFIX = "past_key_values."


def grown_kv_greedy(model: Path, prompt: list[int], new_tokens: int) -> tuple[list[int],
                                                                            np.ndarray]:
    """Greedy tokens after `prompt`, and the prompt's logits [rows, vocab].

    input_ids in one forward, attention_mask of ones, position_ids = arange, past of shape
    [1, kv_heads, 0, head] at first; then one row per step with the grown KV.
    """
    sess = session(model)
    past = {value.name: np.zeros((1, value.shape[1], 0, value.shape[3]), np.float32)
            for value in sess.get_inputs() if value.name.startswith(PAST_PREFIX)}
    ids = np.asarray([prompt], np.int64)
    length, tokens, prompt_logits = 0, [], None
    for _ in range(new_tokens):
        rows = ids.shape[1]
        outputs = run(sess, {"input_ids": ids,
                             "attention_mask": np.ones((1, length + rows), np.int64),
                             "position_ids": np.arange(length, length + rows)[None], **past})
        if prompt_logits is None:
            prompt_logits = outputs["logits"][0]
        tokens.append(int(np.argmax(outputs["logits"][0, -1])))
        past = carry(outputs)
        length += rows
        ids = np.asarray([[tokens[-1]]], np.int64)
    return tokens, prompt_logits
