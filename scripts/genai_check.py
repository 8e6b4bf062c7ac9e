"""Check that onnxruntime-genai 0.18 loads a reference decoder and agrees with the reference.

Run with the project's interpreter: `.venv/bin/python scripts/genai_check.py`. It creates
`.venv-genai` at the repository root (unless --venv names a ready one), installs
onnxruntime-genai==0.18.0 there (it brings the CPU onnxruntime, which must never share a venv
with onnxruntime-gpu), builds a model with `onnx-chunk build-model`, lets onnxruntime-genai
generate greedily from a prompt of token ids, and compares its tokens with the NumPy
reference's greedy tokens. Exit status 0 when they agree, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENAI_VERSION = "0.18.0"

# Runs inside the genai venv: load the folder, generate greedily, print the tokens as JSON.
_GENAI_PROGRAM = """
import json, sys
import numpy as np
import onnxruntime_genai as og
folder, prompt, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = og.Model(folder)
params = og.GeneratorParams(model)
params.set_search_options(max_length=len(prompt) + steps, do_sample=False)
generator = og.Generator(model, params)
generator.append_tokens(np.array([prompt], dtype=np.int32))
tokens = []
while not generator.is_done() and len(tokens) < steps:
    generator.generate_next_token()
    tokens.append(int(generator.get_next_tokens()[0]))
print(json.dumps({"version": og.__version__, "tokens": tokens}))
"""


def _genai_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run([str(python), "-c", "import onnxruntime_genai as og; "
                            "print(og.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != GENAI_VERSION:
        print(f"installing onnxruntime-genai=={GENAI_VERSION} into {venv}")
        subprocess.run([str(python), "-m", "pip", "install", "-q",
                        f"onnxruntime-genai=={GENAI_VERSION}"], check=True)
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-genai",
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
    python = _genai_python(args.venv)

    from onnx_chunk.models.reference import ReferenceDecoder

    with tempfile.TemporaryDirectory(prefix="genai-check-") as folder:
        subprocess.run([sys.executable, "-m", "onnx_chunk", "build-model", args.preset,
                        "-o", folder, "--seed", str(args.seed), "--variant", args.variant],
                       check=True)
        result = subprocess.run([str(python), "-c", _GENAI_PROGRAM, folder, json.dumps(prompt),
                                 str(args.steps)], capture_output=True, text=True)
        if result.returncode != 0:
            print(f"onnxruntime-genai failed to run the model:\n{result.stderr}")
            return 1
        genai = json.loads(result.stdout.strip().splitlines()[-1])
        reference = ReferenceDecoder.from_model_dir(folder).greedy(prompt, args.steps)
    tokens = genai["tokens"]
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
