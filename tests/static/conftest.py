"""Static-graph fixtures: tiny static decoders, the dynamic GQA decoder and its fix-shapes output,
built once per seed.

Sizes live in `static_sizes.py`, which the test modules import relatively.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest


@pytest.fixture(scope="session")
def static_models(tmp_path_factory):
    """`static_models(chunk_size, capacity, seed)` -> path of a tiny static decoder."""
    from onnx_chunk.models.static_decoder import build_static_decoder

    built = {}

    def build(chunk_size: int, capacity: int, seed: int):
        key = (chunk_size, capacity, seed)
        if key not in built:
            out = tmp_path_factory.mktemp(f"static-c{chunk_size}-C{capacity}-s{seed}")
            built[key] = build_static_decoder(out, "tiny", chunk_size=chunk_size,
                                              capacity=capacity, seed=seed)
        return built[key]

    return build


@pytest.fixture(scope="session")
def dynamic_models(tmp_path_factory):
    """`dynamic_models(seed)` -> path of the tiny dynamic GQA reference decoder."""
    from onnx_chunk.models import build_decoder

    built = {}

    def build(seed: int):
        if seed not in built:
            built[seed] = build_decoder(tmp_path_factory.mktemp(f"dynamic-s{seed}"), "tiny",
                                        "base", seed=seed)
        return built[seed]

    return build


@pytest.fixture(scope="session")
def fixed_pair(dynamic_models, tmp_path_factory):
    """`fix-shapes` output of the dynamic decoder (seed SEED): the folder holding chunk.onnx
    (CHUNK rows) and decode.onnx at capacity CAPACITY."""
    from onnx_chunk.static.fix_shapes import fix_shapes

    from .static_sizes import CAPACITY, CHUNK, SEED

    out = tmp_path_factory.mktemp("fixed")
    fix_shapes(dynamic_models(SEED), out, rows=CHUNK, capacity=CAPACITY)
    return out


@pytest.fixture(scope="session")
def dynamic_greedy(dynamic_models):
    """`dynamic_greedy(seed, prompt, n)`: greedy tokens of the dynamic model run with plain ONNX
    Runtime, the whole prompt in one forward, then one decode step per token."""
    sessions = {}

    def generate(seed: int, prompt, max_new_tokens: int) -> list[int]:
        if seed not in sessions:
            sessions[seed] = ort.InferenceSession(str(dynamic_models(seed)),
                                                  providers=["CPUExecutionProvider"])
        session = sessions[seed]
        names = [port.name for port in session.get_outputs()]
        pasts = [port for port in session.get_inputs()
                 if port.name.startswith("past_key_values.")]
        feeds = {"input_ids": np.array([prompt], dtype=np.int64)}
        feeds.update({port.name: np.zeros((1, port.shape[1], 0, port.shape[3]), np.float32)
                      for port in pasts})
        total = len(prompt)
        tokens: list[int] = []
        while True:
            feeds["attention_mask"] = np.ones((1, total), dtype=np.int64)
            outputs = dict(zip(names, session.run(None, feeds)))
            tokens.append(int(outputs["logits"][0, -1].argmax()))
            if len(tokens) == max_new_tokens:
                return tokens
            total += 1
            feeds = {"input_ids": np.array([[tokens[-1]]], dtype=np.int64)}
            feeds.update({port.name: outputs[port.name.replace("past_key_values", "present")]
                          for port in pasts})

    return generate
