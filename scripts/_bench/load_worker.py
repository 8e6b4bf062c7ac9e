"""Import, load and one short generation of onnx-chunk or onnxruntime-genai, stage by stage.

Runs with either interpreter: the project's (system "onnx-chunk") or the genai venv's
(system "genai", which must never import onnx_chunk); so only the standard library is
imported at the top, and each system's packages inside the stages. argv[1] is a JSON object:
system, mode ("import": the import alone; "load": import, load and one generation), and for
"load": model (the converted model's .onnx; genai takes its folder), prompt, new_tokens,
chunk_size.

Stages, each stamped with `time.monotonic()` (the clock the parent stamps the spawn with):
- started: this module runs (the interpreter has started);
- imported: onnx-chunk `import onnx_chunk` and the access to `onnx_chunk.load` (which imports
  what `load` needs at module level); genai `import numpy, onnxruntime_genai` (genai takes
  its prompts as numpy arrays);
- ready: the load call returned (onnx-chunk: `load(model, provider="cpu", capacity=prompt +
  new tokens)`, which on CPU creates its session on the first forward; genai: `og.Model` of
  the folder's config with its providers cleared, the CPU, which creates its session);
- first_token: the first token of one greedy generation (so every load work a system defers
  to its first forward is done by then, on both sides);
- generated: the rest of that generation, new_tokens in all, stopping at EOS (both).
Each stage reports the resident set (VmRSS) and whether `onnx` and `onnx_ir` are in
sys.modules. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import time

WATCHED_MODULES = ("onnx", "onnx_ir")
EOS_TOKEN_ID = 2


def _resident_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS line in /proc/self/status")


def _stage() -> dict:
    return {"at": time.monotonic(), "rss_mb": _resident_kib() / 1024,
            "modules": [name for name in WATCHED_MODULES if name in sys.modules]}


def _onnx_chunk(request: dict, stages: dict) -> list[int]:
    import onnx_chunk

    load = onnx_chunk.load
    stages["imported"] = _stage()
    if request["mode"] == "import":
        return []
    prompt, new_tokens = request["prompt"], request["new_tokens"]
    runtime = load(request["model"], provider="cpu", chunk_size=request["chunk_size"],
                   capacity=len(prompt) + new_tokens)
    stages["ready"] = _stage()
    with runtime.open_sequence() as sequence:
        stream = sequence.stream(prompt, new_tokens, eos_token_id=EOS_TOKEN_ID)
        tokens = [next(stream)]
        stages["first_token"] = _stage()
        tokens += list(stream)
    stages["generated"] = _stage()
    return tokens


def _genai(request: dict, stages: dict) -> list[int]:
    import numpy as np
    import onnxruntime_genai as og

    stages["imported"] = _stage()
    if request["mode"] == "import":
        return []
    prompt, new_tokens = request["prompt"], request["new_tokens"]
    folder = request["model"].rsplit("/", 1)[0]
    config = og.Config(folder)
    config.clear_providers()
    config.overlay(json.dumps({"search": {"chunk_size": request["chunk_size"]}}))
    model = og.Model(config)
    stages["ready"] = _stage()
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    generator.generate_next_token()
    tokens = [int(generator.get_next_tokens()[0])]
    stages["first_token"] = _stage()
    while not generator.is_done() and len(tokens) < new_tokens:
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    del generator
    stages["generated"] = _stage()
    return tokens


def main() -> None:
    request = json.loads(sys.argv[1])
    stages = {"started": _stage()}
    run = _onnx_chunk if request["system"] == "onnx-chunk" else _genai
    tokens = run(request, stages)
    print(json.dumps({"stages": stages, "tokens": tokens}))


if __name__ == "__main__":
    main()
