"""onnxruntime-genai's greedy generation, run with the genai venv's interpreter.

The one place that drives onnxruntime-genai: the benchmarks measure with it, and
scripts/genai_check.py and scripts/genai_parity.py take its tokens. It must not import
onnx_chunk: that venv holds the CPU onnxruntime that onnxruntime-genai brings. argv[1] is a
JSON object: model (folder with genai_config.json), prompts (or prompts_file: a JSON file
holding them, for prompts too long for one argument), new_tokens, chunk_size
(search.chunk_size; 0 leaves it unset), and optionally margins (true: each result also lists,
per generated token, the gap between the two largest logits genai chose from, which tells a
near-tie from a real difference) and max_length (genai's search.max_length for every prompt;
default the prompt plus new_tokens; genai 0.18 refuses a sliding-window export whose
max_length is under the window), threads (optional: the decoder session's
intra_op_num_threads; default ORT's, one per core). Prompts are served in order by one model on
the CPU; generation stops at new_tokens or at EOS. Prints one JSON object shaped like
chunk_worker's:
TTFT runs from handing over the prompt to the first token; decode tokens/s counts the tokens
after the first over the time after the first, as onnx-chunk does.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import onnxruntime_genai as og


def main() -> None:
    request = json.loads(sys.argv[1])
    began = time.perf_counter()
    config = og.Config(request["model"])
    config.clear_providers()
    if request["chunk_size"] > 0:
        config.overlay(json.dumps({"search": {"chunk_size": request["chunk_size"]}}))
    if request.get("threads"):
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": request["threads"]}}}}))
    model = og.Model(config)
    load_s = time.perf_counter() - began
    want_margins = bool(request.get("margins"))
    results = []
    if "prompts_file" in request:
        with open(request["prompts_file"]) as file:
            request["prompts"] = json.load(file)
    for prompt in request["prompts"]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=request.get("max_length") or
                                  len(prompt) + request["new_tokens"], do_sample=False)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        margins: list[float] = []
        generator.append_tokens(np.array([prompt], dtype=np.int32))
        step(generator, margins, want_margins)
        tokens = [int(generator.get_next_tokens()[0])]
        ttft = time.perf_counter() - start
        while not generator.is_done() and len(tokens) < request["new_tokens"]:
            step(generator, margins, want_margins)
            tokens.append(int(generator.get_next_tokens()[0]))
        total = time.perf_counter() - start
        decode_s = total - ttft
        results.append({
            "prompt_tokens": len(prompt),
            "ttft_s": ttft,
            "decode_tokens_per_s": (len(tokens) - 1) / decode_s if len(tokens) > 1 else None,
            "total_s": total,
            "tokens": tokens,
            **({"margins": margins} if want_margins else {}),
        })
        del generator
    print(json.dumps({"load_s": load_s, "results": results, "version": og.__version__}))


def step(generator: og.Generator, margins: list[float], want_margins: bool) -> None:
    """Generate one token; with `want_margins`, first note the top-2 gap of its logits."""
    if want_margins:
        logits = np.asarray(generator.get_logits(), dtype=np.float64).reshape(-1)
        top = np.partition(logits, -2)[-2:]
        margins.append(float(top[1] - top[0]))
    generator.generate_next_token()


if __name__ == "__main__":
    main()
