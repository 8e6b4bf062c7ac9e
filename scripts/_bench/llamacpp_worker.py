"""llama.cpp's greedy generation through llama-cpp-python's C API (run with the llama.cpp venv).

It imports neither onnx_chunk nor onnxruntime. argv[1] is a JSON object: model (a .gguf file),
prompts, new_tokens, chunk_size (llama.cpp's n_batch and n_ubatch: prompt rows per decode
call), threads (n_threads and n_threads_batch). For each prompt a context of capacity prompt +
new tokens is created (llama.cpp's defaults otherwise, flash attention on "auto"), the prompt
is decoded in chunks asking logits of its last row only, then one decode per new token with a
numpy argmax of its logits, as llama.cpp's own simple example does; no EOS stop. Prints one
JSON object shaped like chunk_worker's, with llama.cpp's system info.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import llama_cpp as llama
import numpy as np


@llama.llama_log_callback
def _quiet(level, text, user_data):
    """llama.cpp logs every load to stderr; the benchmark keeps stderr for errors."""


def _decode(context, batch, tokens: list[int], first_position: int, sequence: int = 0,
            every_row: bool = False) -> None:
    """Decode `tokens` of `sequence` from `first_position`, the last row's logits asked for
    (`every_row`: each row's)."""
    batch.n_tokens = len(tokens)
    for index, token in enumerate(tokens):
        batch.token[index] = token
        batch.pos[index] = first_position + index
        batch.n_seq_id[index] = 1
        batch.seq_id[index][0] = sequence
        batch.logits[index] = every_row or index == len(tokens) - 1
    status = llama.llama_decode(context, batch)
    if status != 0:
        raise SystemExit(f"llama_decode returned {status}")


def _next_token(context, vocab_size: int) -> int:
    logits = llama.llama_get_logits_ith(context, -1)
    return int(np.argmax(np.ctypeslib.as_array(logits, shape=(vocab_size,))))


def generate(model, vocab_size: int, prompt: list[int], new_tokens: int, chunk: int,
             threads: int) -> dict:
    params = llama.llama_context_default_params()
    params.n_ctx = len(prompt) + new_tokens
    params.n_batch = params.n_ubatch = chunk
    params.n_threads = params.n_threads_batch = threads
    params.n_seq_max = 1
    context = llama.llama_init_from_model(model, params)
    if not context:
        raise SystemExit("llama_init_from_model failed")
    batch = llama.llama_batch_init(chunk, 0, 1)
    try:
        start = time.perf_counter()
        for offset in range(0, len(prompt), chunk):
            _decode(context, batch, prompt[offset:offset + chunk], offset)
        tokens = [_next_token(context, vocab_size)]
        ttft = time.perf_counter() - start
        while len(tokens) < new_tokens:
            _decode(context, batch, tokens[-1:], len(prompt) + len(tokens) - 1)
            tokens.append(_next_token(context, vocab_size))
        total = time.perf_counter() - start
    finally:
        llama.llama_batch_free(batch)
        llama.llama_free(context)
    return {"prompt_tokens": len(prompt), "ttft_s": ttft,
            "decode_tokens_per_s": (len(tokens) - 1) / (total - ttft) if len(tokens) > 1 else None,
            "total_s": total, "tokens": tokens}


def load_model(path: str):
    """The llama.cpp model at `path` (the backend initialised first) and its vocabulary size."""
    llama.llama_backend_init()
    model = llama.llama_model_load_from_file(path.encode(), llama.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    return model, llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))


def main() -> None:
    request = json.loads(sys.argv[1])
    llama.llama_log_set(_quiet, ctypes.c_void_p())
    began = time.perf_counter()
    model, vocab_size = load_model(request["model"])
    load_s = time.perf_counter() - began
    results = [generate(model, vocab_size, prompt, request["new_tokens"], request["chunk_size"],
                        request["threads"]) for prompt in request["prompts"]]
    print(json.dumps({"load_s": load_s, "results": results, "version": llama.__version__,
                      "system_info": llama.llama_print_system_info().decode().strip()}))


if __name__ == "__main__":
    main()
