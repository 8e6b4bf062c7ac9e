"""One request at a time on the onnx_chunk found first on sys.path (the tree under test).

The parent runs it with PYTHONPATH set to a checkout of the repository, so the checkout's
onnx_chunk is imported (this tree's or a baseline's); the result names `onnx_chunk.__file__`
for the parent to check. argv[1] is a JSON object: model, path ("generate": a `Sequence`'s
`generate`, one sequence per prompt; "submit": `runtime.submit` on a runtime loaded with
max_batch=1), prompts, new_tokens, chunk_size, capacity, repeats. No EOS stop. After load,
one 8-token prompt with 2 new tokens warms the path up; then every prompt `repeats` times in a
row (one 64-token decode is too short to time alone on a noisy machine). Prints the median
TTFT and decode tokens/s of each prompt's runs, and its tokens (the same in every run, or
the worker fails).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import statistics
import sys
from typing import Any

import onnx_chunk


def _generate(runtime, prompt: list[int], new_tokens: int) -> dict:
    with runtime.open_sequence() as sequence:
        tokens = sequence.generate(prompt, new_tokens, eos_token_id=[])
        generation = sequence.stats.last_generation
    return {"tokens": tokens, "ttft_s": generation.ttft_s,
            "decode_tokens_per_s": generation.decode_tokens_per_s}


def _submit(runtime, prompt: list[int], new_tokens: int) -> dict:
    request = runtime.submit(prompt, new_tokens, eos_token_id=[])
    tokens = request.result()
    stats = request.stats
    return {"tokens": tokens, "ttft_s": stats.ttft_s,
            "decode_tokens_per_s": stats.decode_tokens_per_s}


PATHS = {"generate": _generate, "submit": _submit}


def _has_option(name: str) -> bool:
    """Whether the tree's `load` takes the option `name`: a field of its `RuntimeOptions`
    (`load(path, **fields)`), or, in a tree from before those, a parameter of `Runtime`."""
    options = getattr(onnx_chunk, "RuntimeOptions", None)
    if options is not None:
        return name in {field.name for field in dataclasses.fields(options)}
    return name in inspect.signature(onnx_chunk.Runtime).parameters


def _repeated(run, runtime, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    runs = [run(runtime, prompt, new_tokens) for _ in range(repeats)]
    if any(each["tokens"] != runs[0]["tokens"] for each in runs):
        raise SystemExit("the same prompt gave different greedy tokens in one process")
    return {"tokens": runs[0]["tokens"],
            "ttft_s": statistics.median(each["ttft_s"] for each in runs),
            "decode_tokens_per_s": statistics.median(each["decode_tokens_per_s"]
                                                     for each in runs)}


def main() -> None:
    request = json.loads(sys.argv[1])
    run = PATHS[request["path"]]
    # A prompt run again would reuse its own kept prefix (prefix reuse, where the tree has it):
    # off, so that every run prefills the whole prompt as the baseline's does.
    reuse: dict[str, Any] = {"prefix_reuse": False} if _has_option("prefix_reuse") else {}
    with onnx_chunk.load(request["model"], provider="cpu", chunk_size=request["chunk_size"],
                         capacity=request["capacity"], max_batch=1, **reuse) as runtime:
        run(runtime, request["prompts"][0][:8], 2)
        results = [_repeated(run, runtime, prompt, request["new_tokens"],
                             request.get("repeats", 1)) for prompt in request["prompts"]]
    print(json.dumps({"onnx_chunk_file": onnx_chunk.__file__, "results": results}))


if __name__ == "__main__":
    main()
