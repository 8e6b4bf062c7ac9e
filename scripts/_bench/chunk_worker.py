"""Measurement process for onnx-chunk (run with the project's interpreter).

argv[1] is a JSON object: model, prompts (lists of token ids), new_tokens, chunk_size,
padding (true/false/null), mask_policy (null: the provider's), specialize (null: the
provider's default, on CPU one shape-generic session; true: per-width variants), warm (create
the decode variant, and every ladder variant when padding is on, before the first request, as a
server does at start; the widths of unpadded chunks cannot be known before), eos, capacity (null:
the model's maximum sequence length), threads (optional: ORT's intra-op threads; default
ORT's, one per core).
Prints one JSON object: load_s (load and warm-up) and one result per prompt, served in order
by one runtime.
"""

from __future__ import annotations

import json
import sys
import time

import onnx_chunk.runtime as rt
from onnx_chunk.ladder import DECODE_WIDTH
from onnx_chunk.runtime import debug


def _warm(runtime: rt.Runtime) -> None:
    options = runtime.debug.options
    widths = (*options.tiers, DECODE_WIDTH) if options.padding else (DECODE_WIDTH,)
    for width in widths:
        key = debug.variant_key(width, options.tiers, options.specialize)
        with runtime.debug.cache.acquire(key):
            pass


def main() -> None:
    request = json.loads(sys.argv[1])
    began = time.perf_counter()
    runtime = rt.load(request["model"], provider="cpu", chunk_size=request["chunk_size"],
                      padding=request.get("padding"), mask_policy=request.get("mask_policy"),
                      specialize=request.get("specialize"), capacity=request.get("capacity"),
                      intra_op_threads=request.get("threads"))
    if request.get("warm", True):
        _warm(runtime)
    load_s = time.perf_counter() - began
    results = []
    for prompt in request["prompts"]:
        sequence = runtime.open_sequence()
        start = time.perf_counter()
        tokens = sequence.generate(prompt, request["new_tokens"], eos_token_id=request["eos"])
        total = time.perf_counter() - start
        generation = sequence.stats.last_generation
        assert generation is not None  # set by generate()
        results.append({
            "prompt_tokens": len(prompt),
            "ttft_s": generation.ttft_s,
            "decode_tokens_per_s": generation.decode_tokens_per_s,
            "total_s": total,
            "tokens": tokens,
            "chunks": [[chunk.rows, chunk.width] for chunk in generation.chunks],
        })
    stats = runtime.stats
    print(json.dumps({"load_s": load_s, "results": results, "padding": stats.padding != "off",
                      "specialize": stats.specialize,
                      "mask_policy": stats.mask_policy, "compiles": stats.cache.compiles,
                      "evictions": stats.cache.evictions}))


if __name__ == "__main__":
    main()
