"""Measurement process for the batch engine (run with the project's interpreter).

argv[1] is a JSON object: model, mode, chunk_size, capacity, batch, optionally threads (ONNX
Runtime's intra-op threads; default its own), and per mode:
- "throughput": prompts, new_tokens. batch 1 serves them one after another on one sequence
  (what `generate --batch 1` does); above 1 through `generate_many`. No EOS stop, so every
  system produces the same number of tokens. Prints wall_s of the generation (the load and a
  one-prompt warm-up excluded), the tokens of each prompt, and the time in prefill and in
  decode forwards with the count of decode forwards.
- "stall": running (the running requests' prompt length), long (the admitted prompt). The
  running requests decode until the long prompt's first token; prints the longest gap
  between two tokens of a running request (`Request.token_times`: when the engine produced
  them) from the long prompt's submit to its first token,
  the engine's counters, and the longest prefill forward of the long prompt run alone on the
  idle runtime (what one chunk costs).
"""

from __future__ import annotations

import json
import sys
import time

import onnx_chunk.runtime as rt


def main() -> None:
    request = json.loads(sys.argv[1])
    runtime = rt.load(request["model"], provider="cpu", chunk_size=request["chunk_size"],
                      capacity=request["capacity"], max_batch=request["batch"],
                      intra_op_threads=request.get("threads"))
    result = (_throughput(runtime, request) if request["mode"] == "throughput"
              else _stall(runtime, request))
    runtime.close()
    print(json.dumps(result))


def _throughput(runtime: rt.Runtime, request: dict) -> dict:
    prompts, new_tokens = request["prompts"], request["new_tokens"]
    _generate(runtime, request["batch"], [prompts[0][:8]], 2)
    before = runtime.stats.engine
    began = time.perf_counter()
    tokens, phases = _generate(runtime, request["batch"], prompts, new_tokens)
    wall = time.perf_counter() - began
    engine = runtime.stats.engine
    if engine is not None:
        assert before is not None  # the warm-up request started the engine
        phases = {"prefill_s": engine.prefill_s - before.prefill_s,
                  "decode_s": engine.decode_s - before.decode_s,
                  "decode_forwards": engine.decode_steps - before.decode_steps,
                  "rows_per_decode_step": (engine.decode_rows - before.decode_rows)
                  / (engine.decode_steps - before.decode_steps)}
    return {"wall_s": wall, "tokens": tokens, **phases}


def _generate(runtime: rt.Runtime, batch: int, prompts: list,
              new_tokens: int) -> tuple[list, dict]:
    """The tokens of every prompt, and (batch 1) the time in prefill and in decode steps."""
    if batch > 1:
        return runtime.generate_many(prompts, new_tokens, eos_token_id=[]), {}
    tokens = []
    prefill_s = decode_s = 0.0
    with runtime.open_sequence() as sequence:
        for prompt in prompts:
            sequence.rewind(sequence.length)
            tokens.append(sequence.generate(prompt, new_tokens, []))
            generation = sequence.stats.last_generation
            assert generation is not None and generation.ttft_s is not None
            prefill_s += generation.ttft_s
            decode_s += generation.decode_s
    return tokens, {"prefill_s": prefill_s, "decode_s": decode_s,
                    "decode_forwards": len(prompts) * (new_tokens - 1),
                    "rows_per_decode_step": 1.0}


def _stall(runtime: rt.Runtime, request: dict) -> dict:
    long = request["long"]
    running_prompt = list(range(3, 3 + request["running"]))
    # Warm up the prefill and decode paths on the idle runtime.
    runtime.generate_many([running_prompt], 4, eos_token_id=[])
    running = []
    for _ in range(request["batch"] - 1):
        submitted_s = time.perf_counter()
        running.append((submitted_s, runtime.submit(
            running_prompt, runtime.stats.capacity - len(running_prompt), eos_token_id=[])))
    for _, submitted in running:
        next(submitted.tokens())
    submit_s = time.perf_counter()
    admitted = runtime.submit(long, 1, eos_token_id=[])
    admitted.result()
    assert admitted.stats.ttft_s is not None  # its first token came
    first_s = submit_s + admitted.stats.ttft_s
    gaps = []
    for submitted_s, submitted in running:
        # The gap that spans the prompt's last forward ends with the next decode's token.
        tokens = submitted.tokens()
        while submitted_s + submitted.token_times[-1] <= first_s:
            next(tokens)
        submitted.cancel()
        stamps = [submitted_s + offset for offset in submitted.token_times]
        gaps += [later - earlier for earlier, later in zip(stamps, stamps[1:])
                 if later > submit_s and earlier < first_s]
    engine = runtime.stats.engine
    assert engine is not None  # requests were submitted
    with runtime.open_sequence() as alone:
        alone.generate(long, 1, [])
        generation = alone.stats.last_generation
        assert generation is not None  # set by generate()
        chunks = generation.chunks
    return {"longest_gap_s": max(gaps), "gaps": len(gaps), "ttft_s": admitted.stats.ttft_s,
            "chunk_forward_s": max(chunk.seconds for chunk in chunks),
            "chunks": len(chunks), "decode_stalls": engine.decode_stalls}


if __name__ == "__main__":
    main()
