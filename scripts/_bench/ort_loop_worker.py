"""A bare ONNX Runtime loop over a builder export: the floor a runtime on ORT can reach.

Run with an interpreter that has onnxruntime (it imports neither onnx_chunk nor genai). argv[1]
is a JSON object: model (folder with genai_config.json), prompts, new_tokens, chunk_size (rows
per prefill forward; 0: the whole prompt at once), threads (ORT's intra-op threads). For each
prompt: one KV buffer per layer's key and value at capacity (prompt + new tokens), bound as
both past and present (genai's shared-buffer layout, which GroupQueryAttention reads through
the attention mask's width), the prompt forwarded in chunks through one IOBinding, then one
forward per new token and a numpy argmax of its logits; no EOS stop. Prints one JSON object
shaped like chunk_worker's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

PAST, PRESENT = "past_key_values.", "present."


def _session(folder: Path, threads: int) -> tuple[ort.InferenceSession, dict]:
    config = json.loads((folder / "genai_config.json").read_text())["model"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(folder / config["decoder"]["filename"]), options,
                                   providers=["CPUExecutionProvider"])
    return session, config


def _bind(io: ort.IOBinding, name: str, array: np.ndarray, output: bool = False) -> None:
    bind = io.bind_output if output else io.bind_input
    bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)


def _forward(session, io, ids: list[int], past: int, vocab: int) -> np.ndarray:
    tokens = np.array([ids], dtype=np.int64)
    mask = np.ones((1, past + len(ids)), dtype=np.int64)
    logits = np.empty((1, len(ids), vocab), dtype=np.float32)
    _bind(io, "input_ids", tokens)
    _bind(io, "attention_mask", mask)
    _bind(io, "logits", logits, output=True)
    session.run_with_iobinding(io)
    return logits[0, -1]


def generate(session, config: dict, prompt: list[int], new_tokens: int, chunk: int) -> dict:
    decoder = config["decoder"]
    capacity = len(prompt) + new_tokens
    shape = (1, decoder["num_key_value_heads"], capacity, decoder["head_size"])
    io = session.io_binding()
    buffers = []
    for name in (each.name for each in session.get_inputs()):
        if name.startswith(PAST):
            buffer = np.zeros(shape, dtype=np.float32)
            buffers.append(buffer)
            _bind(io, name, buffer)
            _bind(io, PRESENT + name.removeprefix(PAST), buffer, output=True)
    vocab = config["vocab_size"]
    width = chunk or len(prompt)
    start = time.perf_counter()
    for offset in range(0, len(prompt), width):
        last = _forward(session, io, prompt[offset:offset + width], offset, vocab)
    tokens = [int(np.argmax(last))]
    ttft = time.perf_counter() - start
    while len(tokens) < new_tokens:
        last = _forward(session, io, tokens[-1:], len(prompt) + len(tokens) - 1, vocab)
        tokens.append(int(np.argmax(last)))
    total = time.perf_counter() - start
    return {"prompt_tokens": len(prompt), "ttft_s": ttft,
            "decode_tokens_per_s": (len(tokens) - 1) / (total - ttft) if len(tokens) > 1 else None,
            "total_s": total, "tokens": tokens}


def main() -> None:
    request = json.loads(sys.argv[1])
    began = time.perf_counter()
    session, config = _session(Path(request["model"]), request["threads"])
    load_s = time.perf_counter() - began
    results = [generate(session, config, prompt, request["new_tokens"], request["chunk_size"])
               for prompt in request["prompts"]]
    print(json.dumps({"load_s": load_s, "results": results, "version": ort.__version__}))


if __name__ == "__main__":
    main()
