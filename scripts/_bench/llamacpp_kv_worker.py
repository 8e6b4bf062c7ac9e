"""llama.cpp's KV cache at a shape: its bytes and the process's peak RSS (the llama.cpp venv).

argv[1] is a JSON object: model (a .gguf file), slots, capacity (positions per slot), cache
(`f16`, `q8_0` or `q4_0`: type_k and type_v), threads. One context holds `slots` sequences of
`capacity` positions each (n_ctx = slots x capacity, n_seq_max = slots, not unified: one cache
stream per sequence), flash attention on (llama.cpp quantizes the V cache only with it).
llama.cpp zeroes every KV buffer as it makes the context (`ggml_backend_buffer_clear` in
llama_kv_cache's constructor, src/llama-kv-cache.cpp), so all of the cache is resident, as
bench_kv_cache.py's onnx-chunk child makes its own by zeroing its sequences' KV buffers. Each
sequence then decodes a 4-token prompt and 4 greedy tokens in turn. The KV bytes are what
llama.cpp's own log line reports for its KV buffers ("KV buffer size = X MiB"; the sum over
them); the peak RSS is this process's VmHWM. Prints one JSON object.
"""

from __future__ import annotations

import ctypes
import json
import re
import sys

import llama_cpp as llama
from llamacpp_worker import _decode, _next_token, load_model

CACHE_TYPES = {"f16": llama.GGML_TYPE_F16, "q8_0": llama.GGML_TYPE_Q8_0,
               "q4_0": llama.GGML_TYPE_Q4_0}
_LOG: list[str] = []
_KV_LINE = re.compile(r"KV buffer size\s*=\s*([0-9.]+) MiB")


@llama.llama_log_callback
def _keep(level, text, user_data):
    _LOG.append(text.decode(errors="replace"))


def _vmhwm() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM line in /proc/self/status")


def main() -> None:
    request = json.loads(sys.argv[1])
    slots, capacity = int(request["slots"]), int(request["capacity"])
    llama.llama_log_set(_keep, ctypes.c_void_p())
    model, vocab_size = load_model(request["model"])
    params = llama.llama_context_default_params()
    params.n_ctx = slots * capacity
    params.n_seq_max = slots
    params.kv_unified = False
    params.n_batch = params.n_ubatch = 512
    params.n_threads = params.n_threads_batch = int(request["threads"])
    params.type_k = params.type_v = CACHE_TYPES[request["cache"]]
    params.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
    context = llama.llama_init_from_model(model, params)
    if not context:
        raise SystemExit(f"llama_init_from_model failed for a {request['cache']} cache of "
                         f"{slots} x {capacity}")
    batch = llama.llama_batch_init(512, 0, slots)
    try:
        for slot in range(slots):
            tokens = [5 + slot, 6, 7, 8]
            _decode(context, batch, tokens, 0, slot)
            tokens.append(_next_token(context, vocab_size))
            for _ in range(7):
                _decode(context, batch, tokens[-1:], len(tokens) - 1, slot)
                tokens.append(_next_token(context, vocab_size))
    finally:
        llama.llama_batch_free(batch)
    kv_mib = sum(float(match.group(1)) for line in _LOG for match in [_KV_LINE.search(line)]
                 if match)
    peak = _vmhwm()
    llama.llama_free(context)
    print(json.dumps({"kv_bytes": int(kv_mib * 2**20), "peak_rss": peak,
                      "kv_log": [line.strip() for line in _LOG if "KV" in line][:6],
                      "version": llama.__version__}))


if __name__ == "__main__":
    main()
