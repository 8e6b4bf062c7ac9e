"""Measurement process for scripts/bench_weights.py: resident memory as sessions are added.

argv[1] is a JSON object: model, mode ("shared": onnx-chunk's per-width variants, one copy of
the weights; "generic": onnx-chunk's CPU default, one shape-generic session that loads its own
weights; "naive": one plain ONNX Runtime session per width, each loading the model itself),
widths.
Each width gets its session and one forward at that width (so the weights a kernel touches are
resident); the process's resident set is read after each. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnx_chunk.runtime import debug

# The process's resident set, as the variant cache's CPU meter reads it.
process_rss_bytes = debug.meter_for("cpu").used_bytes


def _onnx_chunk(model: str, widths: list[int], specialize: bool) -> list[dict]:
    import onnx_chunk

    runtime = onnx_chunk.load(model, provider="cpu", chunk_size=max(widths), padding=False,
                              specialize=specialize)
    sequence = runtime.open_sequence()
    rows = []
    for width in widths:
        if width == 1:
            sequence.decode(1)
        else:
            sequence.prefill(np.ones(width, dtype=np.int64))
        sequence.rewind(sequence.length)
        stats = runtime.debug.cache.snapshot()
        rows.append({"width": width, "rss": process_rss_bytes(), "variants": stats.variants,
                     "bytes_held": stats.bytes_held,
                     "weights_resident": runtime.stats.weights_resident_bytes})
    return rows


def _naive(model: str, widths: list[int]) -> list[dict]:
    sessions = []
    rows = []
    for width in widths:
        options = ort.SessionOptions()
        options.add_free_dimension_override_by_name("batch_size", 1)
        options.add_free_dimension_override_by_name("sequence_length", width)
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        sessions.append(session)
        feeds = {"input_ids": np.ones((1, width), np.int64),
                 "attention_mask": np.ones((1, width), np.int64)}
        for value in session.get_inputs():
            if value.name.startswith("past_key_values."):
                heads, head_size = value.shape[1], value.shape[3]
                if not isinstance(head_size, int):  # a builder export's symbolic kv_cache_dim
                    head_size = _genai_head_size(model)
                feeds[value.name] = np.zeros((1, heads, 0, head_size), np.float32)
        session.run(["logits"], feeds)
        rows.append({"width": width, "rss": process_rss_bytes(), "variants": len(sessions),
                     "bytes_held": None})
    return rows


def _genai_head_size(model: str) -> int:
    config = json.loads((Path(model).parent / "genai_config.json").read_text())
    return int(config["model"]["decoder"]["head_size"])


def main() -> None:
    request = json.loads(sys.argv[1])
    before = process_rss_bytes()
    mode, model, widths = request["mode"], request["model"], request["widths"]
    rows = (_naive(model, widths) if mode == "naive"
            else _onnx_chunk(model, widths, specialize=mode == "shared"))
    print(json.dumps({"baseline_rss": before, "rows": rows}))


if __name__ == "__main__":
    main()
