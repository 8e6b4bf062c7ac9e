"""Check that onnxruntime-genai 0.18 loads a reference decoder and agrees with the reference.

Run with the project's interpreter: `.venv/bin/python scripts/genai_check.py`. It uses
`.venv-genai` at the repository root (unless --venv names another; created with
onnxruntime-genai==0.18.0 when missing — that package brings the CPU onnxruntime, which must
never share a venv with onnxruntime-gpu), builds a model with `onnx-chunk build-model`, lets
onnxruntime-genai generate greedily from a prompt of token ids (scripts/_bench/genai_worker.py)
and compares its tokens with the NumPy reference's greedy tokens. Exit status 0 when they
agree, 1 otherwise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from _bench import environment as env
from _bench.child import ChildFailed, run_child


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=env.ROOT / ".venv-genai",
                        help="venv holding onnxruntime-genai (created when missing)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--variant", default="base",
                        help="base, int4, position_ids, last_token_logits or conv_hybrid "
                             "(the variants whose inputs genai knows)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=16, help="tokens to generate")
    parser.add_argument("--prompt", default="5,17,42,99,3,250,7,11,64,128",
                        help="comma-separated token ids")
    args = parser.parse_args(argv)
    prompt = [int(token) for token in args.prompt.split(",")]
    python = env.genai_python(args.venv)

    from onnx_chunk.models.reference import ReferenceDecoder

    with tempfile.TemporaryDirectory(prefix="genai-check-") as folder:
        subprocess.run([sys.executable, "-m", "onnx_chunk", "build-model", args.preset,
                        "-o", folder, "--seed", str(args.seed), "--variant", args.variant],
                       check=True)
        try:
            genai = run_child(env.worker_argv(python, "genai_worker", {
                "model": folder, "prompts": [prompt], "new_tokens": args.steps,
                "chunk_size": 0}), timeout_s=600).payload
        except ChildFailed as error:
            print(f"onnxruntime-genai failed to run the model: {error}")
            return 1
        reference = ReferenceDecoder.from_model_dir(folder).greedy(prompt, args.steps)
    tokens = genai["results"][0]["tokens"]
    print(f"onnxruntime-genai {genai['version']}: {tokens}")
    print(f"numpy reference:        {reference}")
    # genai stops at the EOS token; the reference keeps going, so compare genai's length.
    agree = bool(tokens) and tokens == reference[:len(tokens)]
    if len(tokens) < args.steps:
        print(f"(onnxruntime-genai stopped at EOS after {len(tokens)} tokens)")
    print("tokens agree" if agree else "tokens DIFFER")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
