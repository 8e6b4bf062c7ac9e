"""Check that onnx-chunk's greedy tokens equal onnxruntime-genai's, token for token.

Builds a reference decoder (with its genai_config.json) and generates from prompts around the
chunk boundaries with both runtimes on CPU, onnxruntime-genai with `search.chunk_size` set to
the chunk width onnx-chunk uses. onnxruntime-genai pulls the CPU onnxruntime wheel, which must
not share a venv with onnxruntime-gpu, so it runs in its own venv through
scripts/_bench/genai_worker.py: `.venv-genai`, created when missing, unless --genai-python
names an interpreter that already has onnxruntime-genai.

    .venv/bin/python scripts/genai_parity.py [--genai-python PATH]

Exit status 0 when every prompt gives the same tokens, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
from _bench import environment as env
from _bench.child import ChildFailed, run_child

from onnx_chunk.models import build_decoder
from onnx_chunk.runtime import load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--variant", default="base")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=None,
                        help="KV capacity (default: the longest prompt plus the new tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--genai-python", default=None,
                        help="a Python with onnxruntime-genai (default: .venv-genai, created "
                             "when missing)")
    args = parser.parse_args(argv)
    width = args.chunk_size
    lengths = [1, width - 1, width, width + 1, 2 * width + 13, 3 * width + width // 2]
    capacity = args.capacity or max(lengths) + args.max_new_tokens
    rng = np.random.default_rng(args.seed)
    python = (Path(args.genai_python) if args.genai_python
              else env.genai_python(env.ROOT / ".venv-genai"))
    with tempfile.TemporaryDirectory(prefix="genai-parity-") as folder:
        model_path = build_decoder(Path(folder), preset=args.preset, variant=args.variant,
                                   seed=args.seed)
        eos = env.model_config(model_path)["eos_token_id"]
        runtime = load(model_path, provider="cpu", chunk_size=width, capacity=capacity)
        prompts = [rng.integers(3, runtime.stats.vocab_size, n).tolist() for n in lengths]
        ours = [runtime.open_sequence().generate(prompt, args.max_new_tokens, eos)
                for prompt in prompts]
        try:
            genai = run_child(env.worker_argv(python, "genai_worker", {
                "model": str(model_path.parent), "prompts": prompts,
                "new_tokens": args.max_new_tokens, "chunk_size": width}),
                timeout_s=600).payload
        except ChildFailed as error:
            print(f"onnxruntime-genai failed to run the model: {error}")
            return 1
    version, theirs = genai["version"], [result["tokens"] for result in genai["results"]]
    print(f"onnx-chunk vs onnxruntime-genai {version}, {args.preset}/{args.variant}, "
          f"chunk {width}, padding {runtime.stats.padding}")
    agree = True
    for prompt, mine, reference in zip(prompts, ours, theirs):
        same = mine == reference
        agree &= same
        print(f"  prompt {len(prompt):5d} tokens: {'equal' if same else 'DIFFERENT'} "
              f"({len(mine)} tokens){'' if same else f' ours {mine} genai {reference}'}")
    print("all equal" if agree else "MISMATCH")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
