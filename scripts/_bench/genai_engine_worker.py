"""onnxruntime-genai's `og.Engine` serving many prompts at once (run with the genai venv).

It must not import onnx_chunk. argv[1] is a JSON object: model (folder), prompts, new_tokens,
batch (engine.static_batching.max_batch_size). Every prompt is submitted at once; the engine
runs until each has its new tokens (no EOS stop). Prints wall_s (after a one-prompt warm-up)
and the tokens of each prompt, or {"error": ...} when the engine refuses to run here.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import onnxruntime_genai as og


def main() -> None:
    request = json.loads(sys.argv[1])
    try:
        config = og.Config(request["model"])
        config.clear_providers()
        config.overlay(json.dumps({"engine": {"static_batching": {
            "max_batch_size": request["batch"]}}}))
        engine = og.Engine(og.Model(config))
        _serve(engine, [request["prompts"][0][:8]], 2)
        began = time.perf_counter()
        tokens = _serve(engine, request["prompts"], request["new_tokens"])
        wall = time.perf_counter() - began
    except Exception as error:  # the peer's own exception types: reported, not raised
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}))
        return
    print(json.dumps({"wall_s": wall, "tokens": tokens, "version": og.__version__}))


def _serve(engine: og.Engine, prompts: list, new_tokens: int) -> list:
    requests = []
    for prompt in prompts:
        handle = engine.create_request()
        handle.begin_turn(np.array(prompt, dtype=np.int32))
        requests.append(handle)
    tokens: dict[int, list[int]] = {index: [] for index in range(len(prompts))}
    index_of = {id(handle): index for index, handle in enumerate(requests)}
    buffer = engine.create_event_buffer(256)
    while any(len(found) < new_tokens for found in tokens.values()):
        for event in engine.run(buffer):
            index = _index(event.request, requests, index_of)
            if len(tokens[index]) < new_tokens:
                tokens[index].append(int(event.token))
                if len(tokens[index]) == new_tokens:
                    event.request.close()
    return [tokens[index] for index in range(len(prompts))]


def _index(handle, requests: list, index_of: dict) -> int:
    found = index_of.get(id(handle))
    if found is not None:
        return found
    return next(index for index, known in enumerate(requests) if known == handle)


if __name__ == "__main__":
    main()
