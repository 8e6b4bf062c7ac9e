"""A plain ONNX Runtime forward of a whole sequence through an unmodified genai export.

The reference for prompt and token logprobs: the export run once over every token, with an
empty past (zero recurrent state) and a mask of ones, its logits log-softmaxed in float64.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.models._ort import run, session


def full_sequence_logprobs(folder: Path, ids: list[int]) -> np.ndarray:
    """log-softmax of the logits of every row of `ids` [rows, vocab] (row i predicts i + 1)."""
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    sess = session(folder / "model.onnx")
    feeds: dict[str, np.ndarray] = {
        "input_ids": np.asarray([ids], np.int64),
        "attention_mask": np.ones((1, len(ids)), np.int64)}
    for value in sess.get_inputs():
        if value.name.startswith("past_key_values."):
            feeds[value.name] = np.zeros((1, value.shape[1], 0, decoder["head_size"]),
                                         np.float32)
        elif value.name == "position_ids":
            feeds[value.name] = np.arange(len(ids))[None]
        elif value.name.startswith("past."):  # recurrent state (conv): zeros at the start
            feeds[value.name] = np.zeros((1, *value.shape[1:]), np.float32)
    logits = run(sess, feeds)["logits"][0].astype(np.float64)
    peak = logits.max(axis=-1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))
