"""llama.cpp's logits on held-back text, for scripts/bench_int4_accuracy.py (llama.cpp venv).

It imports neither onnx_chunk nor onnxruntime. argv[1] is a JSON object: model (a .gguf file),
windows and prompts (token ids), new_tokens, forced_paths (for each prompt the continuation to
teacher-force, None: the model's own greedy one), chunk_size (n_batch and n_ubatch), threads.
Each window and each prompt gets a context of its own, so no row sees another's cache. Prints
one JSON object with what bench_kv_accuracy.measure collects from onnx-chunk: the windows'
summed negative log-likelihood and the argmax of every row, each prompt's free-running greedy
continuation (no EOS stop), and the argmax of each row along the teacher-forced continuation.
"""

from __future__ import annotations

import ctypes
import json
import sys

import llama_cpp as llama
import numpy as np
from llamacpp_worker import _decode, _quiet, load_model


class _Context:
    """One llama.cpp context of `capacity` rows; `feed` decodes ids and returns their logits."""

    def __init__(self, model, vocab_size: int, capacity: int, chunk: int, threads: int) -> None:
        params = llama.llama_context_default_params()
        params.n_ctx = capacity
        params.n_batch = params.n_ubatch = chunk
        params.n_threads = params.n_threads_batch = threads
        params.n_seq_max = 1
        self.context = llama.llama_init_from_model(model, params)
        if not self.context:
            raise SystemExit("llama_init_from_model failed")
        self.batch = llama.llama_batch_init(chunk, 0, 1)
        self.chunk, self.vocab_size, self.position = chunk, vocab_size, 0

    def feed(self, ids: list[int]) -> np.ndarray:
        """Decode `ids` after what was fed; the float32 logits of every one of their rows."""
        rows = []
        for offset in range(0, len(ids), self.chunk):
            part = ids[offset:offset + self.chunk]
            _decode(self.context, self.batch, part, self.position, every_row=True)
            for index in range(len(part)):
                row = llama.llama_get_logits_ith(self.context, index)
                rows.append(np.ctypeslib.as_array(row, shape=(self.vocab_size,)).copy())
            self.position += len(part)
        return np.stack(rows)

    def close(self) -> None:
        llama.llama_batch_free(self.batch)
        llama.llama_free(self.context)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def main() -> None:
    request = json.loads(sys.argv[1])
    llama.llama_log_set(_quiet, ctypes.c_void_p())
    model, vocab_size = load_model(request["model"])
    chunk, threads, new_tokens = request["chunk_size"], request["threads"], request["new_tokens"]

    def context(capacity: int) -> _Context:
        return _Context(model, vocab_size, capacity, chunk, threads)

    nll, scored, argmax = 0.0, 0, []
    for ids in request["windows"]:
        window = context(len(ids))
        try:
            logits = window.feed(ids)[:-1]
        finally:
            window.close()
        rows = _log_softmax(logits)
        nll -= float(rows[np.arange(len(ids) - 1), ids[1:]].sum())
        scored += len(ids) - 1
        argmax.append(logits.argmax(axis=-1).tolist())
    free, forced = [], []
    for prompt, path in zip(request["prompts"], request["forced_paths"]):
        run = context(len(prompt) + new_tokens)
        try:
            tokens = [int(run.feed(prompt)[-1].argmax())]
            while len(tokens) < new_tokens:
                tokens.append(int(run.feed(tokens[-1:])[-1].argmax()))
        finally:
            run.close()
        free.append(tokens)
        path = tokens if path is None else path
        run = context(len(prompt) + new_tokens)
        try:
            logits = run.feed(prompt + path[:-1])
        finally:
            run.close()
        forced.append(logits[len(prompt) - 1:].argmax(axis=-1).tolist())
    print(json.dumps({"nll_sum": nll, "scored": scored, "argmax": argmax, "free": free,
                      "forced": forced, "version": llama.__version__,
                      "system_info": llama.llama_print_system_info().decode().strip()}))


if __name__ == "__main__":
    main()
