"""Helpers that run a reference decoder in ORT's CPU provider step by step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnx_chunk.models.reference import DecoderState, ReferenceDecoder


def session(model: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


def empty_state_feeds(ref: ReferenceDecoder, batch: int = 1,
                      dtype: type = np.float32) -> dict[str, np.ndarray]:
    c = ref.config
    feeds = {}
    for layer in c.attention_layers:
        for kind in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kind}"] = np.zeros(
                (batch, c.num_kv_heads, 0, c.head_size), dtype)
    for layer in c.conv_layers:
        feeds[f"past.{layer}.conv"] = np.zeros((batch, c.hidden_size, c.conv_kernel - 1),
                                               dtype)
    return feeds


def request_feeds(ref: ReferenceDecoder, ids: np.ndarray, past: int,
                  positions: np.ndarray | None = None,
                  row_scale: np.ndarray | None = None) -> tuple[dict, dict]:
    """(ORT feeds, reference kwargs) for rows `ids` [1, S] after `past` positions."""
    feeds: dict[str, np.ndarray] = {}
    kwargs: dict = {}
    if ref.spec.inputs_embeds:
        embeds = ref.embed(ids)
        feeds["inputs_embeds"] = embeds.astype(np.float32)
        kwargs["inputs_embeds"] = embeds
    else:
        feeds["input_ids"] = ids
        kwargs["input_ids"] = ids
    feeds["attention_mask"] = np.ones((1, past + ids.shape[1]), np.int64)
    if ref.spec.position_ids:
        feeds["position_ids"] = positions
        kwargs["positions"] = positions
    if ref.spec.odd_port:
        feeds["row_scale"] = row_scale
        kwargs["row_scale"] = row_scale
    return feeds, kwargs


def carry(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Past inputs for the next call from this call's present outputs."""
    carried = {}
    for name, value in outputs.items():
        if name.startswith("present.") and name.endswith(".conv"):
            carried["past." + name[len("present."):]] = value
        elif name.startswith("present."):
            carried["past_key_values." + name[len("present."):]] = value
    return carried


def run(sess: ort.InferenceSession, feeds: dict) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def reference_state_as_feeds(state: DecoderState) -> dict[str, np.ndarray]:
    feeds = {}
    for layer, key in state.keys.items():
        feeds[f"past_key_values.{layer}.key"] = key.astype(np.float32)
        feeds[f"past_key_values.{layer}.value"] = state.values[layer].astype(np.float32)
    for layer, conv in state.conv.items():
        feeds[f"past.{layer}.conv"] = conv.astype(np.float32)
    return feeds
