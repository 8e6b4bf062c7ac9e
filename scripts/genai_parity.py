"""Check that onnx-chunk's greedy tokens equal onnxruntime-genai's, token for token.

Builds a reference decoder (with its genai_config.json), sets `search.chunk_size` to the same
chunk width onnx-chunk uses, and generates from prompts around the chunk boundaries with both
runtimes on CPU. onnxruntime-genai pulls the CPU onnxruntime wheel, which must not share a venv
with onnxruntime-gpu, so it runs in its own venv (`.venv-genai`, created here with pip unless
--genai-python names an interpreter that already has onnxruntime-genai).

    .venv/bin/python scripts/genai_parity.py [--genai-python /work/genai-venv/bin/python]

Exit status 0 when every prompt gives the same tokens, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from onnx_chunk.models import build_decoder
from onnx_chunk.runtime import load

ROOT = Path(__file__).resolve().parent.parent
GENAI_VENV = ROOT / ".venv-genai"
GENAI_REQUIREMENT = "onnxruntime-genai==0.18.*"

# Runs inside the genai venv: reads {model_dir, prompts, max_new_tokens} on stdin, prints the
# greedy tokens of every prompt as one JSON list.
_GENAI_PROGRAM = """
import json, sys
import onnxruntime_genai as og
request = json.load(sys.stdin)
config = og.Config(request["model_dir"])
config.clear_providers()
model = og.Model(config)
results = []
for prompt in request["prompts"]:
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + request["max_new_tokens"],
                              do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    tokens = []
    while not generator.is_done() and len(tokens) < request["max_new_tokens"]:
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    results.append(tokens)
print(json.dumps({"version": og.__version__, "tokens": results}))
"""


def genai_python(given: str | None) -> Path:
    """The interpreter that runs onnxruntime-genai, creating .venv-genai when needed."""
    if given is not None:
        return Path(given)
    python = GENAI_VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {GENAI_VENV} with {GENAI_REQUIREMENT}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(GENAI_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", GENAI_REQUIREMENT],
                       check=True)
    return python


def configure_genai(model_dir: Path, chunk_size: int, capacity: int) -> int:
    """Set search.chunk_size and max_length in genai_config.json; return the EOS token id."""
    path = model_dir / "genai_config.json"
    config = json.loads(path.read_text())
    config["search"]["chunk_size"] = chunk_size
    config["search"]["max_length"] = capacity
    path.write_text(json.dumps(config, indent=2))
    return int(config["model"]["eos_token_id"])


def run_genai(python: Path, model_dir: Path, prompts: list[list[int]],
              max_new_tokens: int) -> tuple[str, list[list[int]]]:
    request = json.dumps({"model_dir": str(model_dir), "prompts": prompts,
                          "max_new_tokens": max_new_tokens})
    completed = subprocess.run([str(python), "-c", _GENAI_PROGRAM], input=request,
                               capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise SystemExit(f"onnxruntime-genai failed:\n{completed.stderr}")
    answer = json.loads(completed.stdout.strip().splitlines()[-1])
    return answer["version"], answer["tokens"]


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
                        help="A Python with onnxruntime-genai (default: .venv-genai, created).")
    args = parser.parse_args(argv)
    width = args.chunk_size
    lengths = [1, width - 1, width, width + 1, 2 * width + 13, 3 * width + width // 2]
    capacity = args.capacity or max(lengths) + args.max_new_tokens
    rng = np.random.default_rng(args.seed)
    python = genai_python(args.genai_python)
    with tempfile.TemporaryDirectory(prefix="genai-parity-") as folder:
        model_path = build_decoder(Path(folder), preset=args.preset, variant=args.variant,
                                   seed=args.seed)
        eos = configure_genai(model_path.parent, width, capacity)
        runtime = load(model_path, provider="cpu", chunk_size=width, capacity=capacity)
        prompts = [rng.integers(3, runtime.ports.vocab_size, n).tolist() for n in lengths]
        ours = [runtime.open_sequence().generate(prompt, args.max_new_tokens, eos)
                for prompt in prompts]
        version, theirs = run_genai(python, model_path.parent, prompts, args.max_new_tokens)
    print(f"onnx-chunk vs onnxruntime-genai {version}, {args.preset}/{args.variant}, "
          f"chunk {width}, padding {'on' if runtime.padding else 'off'}")
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
