"""Batched against serial prefill forwards on plain ONNX Runtime (the project's interpreter).

argv[1] is a JSON object: model (a converted decoder), cases ([batch, rows] pairs: one
forward of [batch, rows] input ids against `batch` forwards of [1, rows], every row with an
empty KV cache), decode_past (the cached tokens before one [1, 1] decode forward),
repetitions. One CPU session, ONNX Runtime's defaults except memory patterns off (as the
runtime's shape-generic CPU session). Every shape runs once before timing; then per
repetition every case's batched and serial forms in alternating order, and the decode
forward. Prints the seconds of every timed forward (serial: the sum of its `batch` forwards).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort


def _feeds(session: ort.InferenceSession, batch: int, rows: int, past: int,
           head_size: int | None = None) -> dict:
    feeds: dict[str, np.ndarray] = {"input_ids": np.full((batch, rows), 3, np.int64),
             "attention_mask": np.ones((batch, past + rows), np.int64)}
    for value in session.get_inputs():
        if value.name.startswith("past_key_values."):
            heads, size = value.shape[1], value.shape[3]
            # The builder's exports leave the head size symbolic (kv_cache_dim).
            size = size if isinstance(size, int) else head_size
            if size is None:
                raise SystemExit(f"{value.name}: a symbolic head size and no head_size given")
            feeds[value.name] = np.zeros((batch, int(heads), past, size), np.float32)
    return feeds


def _timed(session: ort.InferenceSession, feeds: dict, times: int) -> float:
    began = time.perf_counter()
    for _ in range(times):
        session.run(["logits"], feeds)
    return time.perf_counter() - began


def main() -> None:
    request = json.loads(sys.argv[1])
    options = ort.SessionOptions()
    options.enable_mem_pattern = False
    session = ort.InferenceSession(request["model"], options,
                                   providers=["CPUExecutionProvider"])
    config = Path(request["model"]).parent / "genai_config.json"
    head = (json.loads(config.read_text())["model"]["decoder"].get("head_size")
            if config.is_file() else None)
    forms = {}
    for batch, rows in request["cases"]:
        forms[f"{batch}x{rows}"] = {"batched": (_feeds(session, batch, rows, 0, head), 1),
                                    "serial": (_feeds(session, 1, rows, 0, head), batch)}
    decode = _feeds(session, 1, 1, request["decode_past"], head)
    for form in forms.values():
        for feeds, _ in form.values():
            session.run(["logits"], feeds)
    session.run(["logits"], decode)
    seconds: dict = {name: {"batched": [], "serial": []} for name in forms}
    seconds["decode"] = []
    for repetition in range(request["repetitions"]):
        for name, form in forms.items():
            order = ("batched", "serial") if repetition % 2 == 0 else ("serial", "batched")
            for kind in order:
                feeds, times = form[kind]
                seconds[name][kind].append(_timed(session, feeds, times))
        seconds["decode"].append(_timed(session, decode, 1))
    print(json.dumps({"seconds": seconds}))


if __name__ == "__main__":
    main()
