"""llama.cpp decoding several sequences in one `llama_batch` (run with the llama.cpp venv).

It imports neither onnx_chunk nor onnxruntime. argv[1] is a JSON object: model (a .gguf file),
prompts (one per sequence), new_tokens, chunk_size (n_batch = n_ubatch), threads. One context
holds a sequence per prompt, each with its own cache stream of prompt + new_tokens positions
(n_seq_max = the prompts, kv_unified off, as llamacpp_kv_worker makes it; flash attention on
"auto", llama.cpp's default). Each prompt is decoded in chunks of its own sequence id (the
last row's logits asked for); then every step is one `llama_decode` of a batch holding each
sequence's last token at its own position, its logits asked for, and a numpy argmax per
sequence (`llama_get_logits_ith`), as llama.cpp's batched example does; no EOS stop. Prints
one JSON object: wall_s (from the first prompt chunk to the last token), prefill_s, decode_s,
decode_forwards, rows_per_decode_step and each sequence's tokens, like engine_worker's
throughput mode.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import llama_cpp as llama
import numpy as np
from llamacpp_worker import _decode, _quiet, load_model


def _step(context, batch, tokens: list[list[int]], positions: list[int]) -> None:
    """One decode of every sequence's last token at its position, each row's logits asked for."""
    batch.n_tokens = len(tokens)
    for row, (sequence, position) in enumerate(zip(tokens, positions)):
        batch.token[row] = sequence[-1]
        batch.pos[row] = position
        batch.n_seq_id[row] = 1
        batch.seq_id[row][0] = row
        batch.logits[row] = True
    status = llama.llama_decode(context, batch)
    if status != 0:
        raise SystemExit(f"llama_decode returned {status}")


def _argmax(context, row: int, vocab_size: int) -> int:
    logits = llama.llama_get_logits_ith(context, row)
    return int(np.argmax(np.ctypeslib.as_array(logits, shape=(vocab_size,))))


def generate(model, vocab_size: int, prompts: list[list[int]], new_tokens: int, chunk: int,
             threads: int) -> dict:
    sequences = len(prompts)
    params = llama.llama_context_default_params()
    params.n_ctx = sequences * (max(len(prompt) for prompt in prompts) + new_tokens)
    params.n_seq_max = sequences
    params.kv_unified = False
    params.n_batch = params.n_ubatch = max(chunk, sequences)
    params.n_threads = params.n_threads_batch = threads
    context = llama.llama_init_from_model(model, params)
    if not context:
        raise SystemExit(f"llama_init_from_model failed for {sequences} sequences")
    batch = llama.llama_batch_init(max(chunk, sequences), 0, sequences)
    try:
        began = time.perf_counter()
        tokens: list[list[int]] = []
        for sequence, prompt in enumerate(prompts):
            for offset in range(0, len(prompt), chunk):
                _decode(context, batch, prompt[offset:offset + chunk], offset, sequence)
            tokens.append([_argmax(context, -1, vocab_size)])
        prefill_s = time.perf_counter() - began
        steps = 0
        while len(tokens[0]) < new_tokens:
            _step(context, batch, tokens,
                  [len(prompt) + len(new) - 1 for prompt, new in zip(prompts, tokens)])
            for row, new in enumerate(tokens):
                new.append(_argmax(context, row, vocab_size))
            steps += 1
        wall_s = time.perf_counter() - began
    finally:
        llama.llama_batch_free(batch)
        llama.llama_free(context)
    return {"wall_s": wall_s, "prefill_s": prefill_s, "decode_s": wall_s - prefill_s,
            "decode_forwards": steps, "rows_per_decode_step": float(sequences),
            "tokens": tokens}


def main() -> None:
    request = json.loads(sys.argv[1])
    llama.llama_log_set(_quiet, ctypes.c_void_p())
    model, vocab_size = load_model(request["model"])
    prompts = request["prompts"]
    # A warm-up of the first prompt's first ids, as engine_worker warms the runtime up.
    generate(model, vocab_size, [prompts[0][:8]], 2, request["chunk_size"], request["threads"])
    result = generate(model, vocab_size, prompts, request["new_tokens"], request["chunk_size"],
                      request["threads"])
    print(json.dumps(dict(result, version=llama.__version__)))


if __name__ == "__main__":
    main()
