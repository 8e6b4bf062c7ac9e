"""What `convert --int4-block-size N` and `--int8-matmul` cost in accuracy on a trained decoder.

Usage: bench_int4_accuracy.py [MODEL] [--float FLOAT] [--blocks 64,128,256] [--int8-matmul]
                              [--out DIR] ...

MODEL is an INT4 builder export (default ``text-int4``: the decoder trained on English licence
texts, exported by onnxruntime-genai's builder with MatMulNBits at block 32; built by
scripts/make_bench_models.py). It is converted with the command users run, ``onnx-chunk
convert``, once as it is (the reference: its weights unchanged) and once per --blocks size with
``--int4-block-size N`` (``--blocks none``: no re-blocked arm), and with ``--int8-matmul`` once
more with that option (its layers' weights int8); FLOAT (default ``text-fp32``, the same
checkpoint exported in float32; ``none`` to skip) is converted too, to set the 4-bit weights'
own cost beside the re-blocking's.
The reference arm keeps the 4-bit weights (``--no-int8-matmul``: the default conversion of a CPU
export rewrites them as int8 matmuls, the arm --int8-matmul adds).
Each folder is measured on the held-back text exactly as scripts/bench_kv_accuracy.py measures a
KV cache (`measure`: perplexity over non-overlapping windows, every row's argmax, greedy
continuations teacher-forced and free-running), each against the float32 export (against the
unchanged INT4 export with ``--float none``).

``--llamacpp`` adds llama.cpp on GGUF files of the same checkpoint (default ``text-f32``, the
converter's float32 GGUF, and ``text-q4_0``, llama.cpp's quantizer; built by
scripts/make_bench_models.py): the same windows and prompts through llama-cpp-python
(_bench/llamacpp_accuracy_worker.py, in the llama.cpp venv), Q4_0 measured against llama.cpp's
own float32 run, so each runtime's quantization is set against its float weights.

Prints a markdown table with the commands, the CPU and the load average; --json writes every
number. `--quick` is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kv_accuracy as accuracy  # noqa: E402  (a script beside this one)
from _bench import environment as env  # noqa: E402
from _bench import venvs  # noqa: E402
from _bench.harness import markdown_table  # noqa: E402
from _bench.models import BenchModelMissing, bench_model, model_folder  # noqa: E402

from onnx_chunk.passes.int4_blocks import INT4_BLOCK_SIZES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench-out" / "int4-accuracy"
REFERENCE = "block 32 (as exported)"
FLOAT = "float32 weights"
INT8 = "int8 matmul (the default)"
LLAMACPP = "llama.cpp "  # an arm's label: this and its GGUF file's stem (llama.cpp text-q4_0)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="text-int4",
                        help="INT4 benchmark model name or export folder (default text-int4)")
    parser.add_argument("--float", dest="float_model", default="text-fp32",
                        help="the float export of the same weights (default text-fp32; none: "
                             "skip it)")
    parser.add_argument("--blocks", default="64,128,256",
                        help="block sizes to re-block to, comma-separated (default 64,128,256)")
    parser.add_argument("--int8-matmul", action="store_true",
                        help="also measure the export converted with --int8-matmul")
    parser.add_argument("--llamacpp", action="store_true",
                        help="also measure llama.cpp on the GGUF files of the same weights")
    parser.add_argument("--gguf-float", default=None,
                        help="with --llamacpp: llama.cpp's float GGUF (a benchmark model name "
                             "or .gguf file; default text-f32)")
    parser.add_argument("--gguf-quant", default=None,
                        help="with --llamacpp: llama.cpp's quantized GGUF (default text-q4_0)")
    parser.add_argument("--llama-python", type=Path, default=None,
                        help="interpreter with llama-cpp-python (default the `llamacpp` "
                             "scratch venv)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder for the converted models (default bench-out/int4-accuracy)")
    accuracy.add_held_out_arguments(parser)
    args = parser.parse_args(argv)
    accuracy.check_held_out_arguments(args)
    given = [option for option, value in (("--gguf-float", args.gguf_float),
                                          ("--gguf-quant", args.gguf_quant),
                                          ("--llama-python", args.llama_python))
             if value is not None]
    if given and not args.llamacpp:
        raise accuracy.BadInput(f"{', '.join(given)} apply to the llama.cpp arm only; add "
                                "--llamacpp or drop them")
    try:
        args.blocks = ([] if args.blocks == "none"
                       else [int(each) for each in args.blocks.split(",")])
    except ValueError:
        raise accuracy.BadInput(f"--blocks takes block sizes such as 64,128, not "
                                f"{args.blocks!r}") from None
    bad = [size for size in args.blocks if size not in INT4_BLOCK_SIZES[1:]]
    if bad or len(set(args.blocks)) != len(args.blocks):
        sizes = ", ".join(map(str, INT4_BLOCK_SIZES[1:]))
        raise accuracy.BadInput(f"--blocks takes distinct sizes of {sizes} (32 is the "
                                f"reference), not {','.join(map(str, args.blocks))}")
    return args


def _folder(given: str) -> Path:
    try:
        return model_folder(given)
    except BenchModelMissing as error:
        raise accuracy.BadInput(str(error)) from error


def _gguf(given: str) -> Path:
    if given.endswith(".gguf"):
        path = Path(given)
        if not path.is_file():
            raise accuracy.BadInput(f"no GGUF file at {given}")
        return path
    try:
        return bench_model(given)
    except BenchModelMissing as error:
        raise accuracy.BadInput(str(error)) from error


def llamacpp_setup(args: argparse.Namespace) -> tuple[Path, dict[str, Path]] | None:
    """(interpreter, {arm: GGUF file}) of --llamacpp, the float arm first, checked before any
    work (BadInput)."""
    if not args.llamacpp:
        return None
    python = Path(args.llama_python or env.llama_python())
    if not python.exists():
        raise accuracy.BadInput(f"--llamacpp: no interpreter at {python} (--llama-python; "
                                f"`{venvs.LLAMACPP.command()}` makes one)")
    files = (_gguf(args.gguf_float or "text-f32"), _gguf(args.gguf_quant or "text-q4_0"))
    if files[0].stem == files[1].stem:
        raise accuracy.BadInput(f"--gguf-float and --gguf-quant name one file stem "
                                f"({files[0].stem}); llama.cpp's arms are labelled by it")
    return python, {LLAMACPP + path.stem: path for path in files}


def llamacpp_arms(args: argparse.Namespace, setup: tuple[Path, dict[str, Path]],
                  windows: list[list[int]], prompts: list[list[int]]
                  ) -> dict[str, dict[str, Any]]:
    """llama.cpp's float and quantized GGUF on the same ids, the quantized one against the
    float one (both through _bench/llamacpp_accuracy_worker.py)."""
    python, paths = setup
    results: dict[str, dict[str, Any]] = {}
    base = None
    for name, path in paths.items():
        request = {"model": str(path), "windows": windows, "prompts": prompts,
                   "new_tokens": args.new_tokens, "chunk_size": args.chunk_size,
                   "threads": args.threads,
                   "forced_paths": [None] * len(prompts) if base is None else base["free"]}
        began = time.monotonic()
        done = subprocess.run(env.worker_argv(python, "llamacpp_accuracy_worker", request),
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"llama.cpp on {path} exited {done.returncode}: "
                               + (done.stderr.strip().splitlines() or ["no output"])[-1])
        found = json.loads(done.stdout)
        nll = found["nll_sum"] / found["scored"]
        result = {"folder": str(path), "tokens_scored": found["scored"], "nll": nll,
                  "perplexity": math.exp(nll), "argmax": found["argmax"],
                  "free": found["free"], "forced": found["forced"],
                  "version": found["version"], "seconds": round(time.monotonic() - began, 1)}
        results[name] = accuracy.agreement(result, base or result)
        base = base or result
        print(f"{name}: perplexity {result['perplexity']:.4f} ({result['seconds']} s)",
              file=sys.stderr, flush=True)
    return results


def run(args: argparse.Namespace) -> dict:
    folder = _folder(args.model)
    float_folder = None if args.float_model == "none" else _folder(args.float_model)
    setup = llamacpp_setup(args)
    held = accuracy.read_held_out(args)
    ids, windows, prompts = accuracy.held_out_inputs(folder, held, args)
    args.out.mkdir(parents=True, exist_ok=True)
    arms: list[tuple[str, Path, list[str]]] = []
    if float_folder is not None:
        arms.append((FLOAT, float_folder, []))
    arms.append((REFERENCE, folder, ["--no-int8-matmul"]))
    arms += [(f"block {size}", folder, ["--int4-block-size", str(size)])
             for size in args.blocks]
    if args.int8_matmul:
        arms.append((INT8, folder, ["--int8-matmul"]))
    load_before = accuracy.load_average()
    results: dict[str, dict[str, Any]] = {}
    commands: dict[str, str] = {}
    base = FLOAT if float_folder is not None else REFERENCE
    for name, source, options in arms:
        converted, command = accuracy.convert(source, args.out, name.split(" (")[0], options)
        commands[name] = " ".join(["onnx-chunk", *command[3:]])
        results[name] = accuracy.measure(converted, windows, prompts, args.new_tokens,
                                         results.get(base), args.chunk_size, args.threads)
        print(f"{name}: perplexity {results[name]['perplexity']:.4f} "
              f"({results[name]['seconds']} s)", file=sys.stderr, flush=True)
    if setup is not None:
        results.update(llamacpp_arms(args, setup, windows, prompts))
    return {"model": str(folder), "float_model": str(float_folder) if float_folder else None,
            "cpu": accuracy.cpu_description(), "load_before": load_before,
            "load_after": accuracy.load_average(), "windows": len(windows),
            "window": args.window, "chunk_size": args.chunk_size, "held_out_tokens": len(ids),
            "prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "convert_commands": commands, "results": results,
            "agreement_with": base}


def table(report: dict, argv: list[str]) -> str:
    results = report["results"]
    block32 = results[REFERENCE]
    floor = results.get(FLOAT)
    rows = []
    for name, result in results.items():
        own_float = (results[next(key for key in results if key.startswith(LLAMACPP))]
                     if name.startswith(LLAMACPP) else floor)
        rows.append([name, f"{result['perplexity']:.4f}",
                     "-" if name.startswith(LLAMACPP)
                     else f"{result['perplexity'] / block32['perplexity']:.4f}",
                     f"{result['perplexity'] / own_float['perplexity']:.4f}" if own_float else "-",
                     f"{100 * result['row_agreement']:.1f}%",
                     f"{100 * result['greedy_agreement']:.1f}%",
                     accuracy.divergence(result["first_divergence"], report["new_tokens"])])
    against = ("its float32 weights (onnx-chunk's float32 export; llama.cpp's float32 GGUF for "
               "llama.cpp)" if floor else REFERENCE)
    return "\n".join([
        "`" + " ".join(["python scripts/bench_int4_accuracy.py", *argv]) + "`",
        f"CPU: {report['cpu']}; load average {report['load_before']} before, "
        f"{report['load_after']} after.",
        f"Held-back text: {report['held_out_tokens']} tokens, {report['windows']} windows of "
        f"{report['window']} (prefill chunks of {report['chunk_size']}); greedy: "
        f"{report['prompts']} prompts of {report['prompt_tokens']} tokens, "
        f"{report['new_tokens']} new tokens each. Agreement is with {against}.",
        "", markdown_table(
            ["weights", "perplexity", "ratio to block 32", "ratio to its float32",
             "row argmax agreement", "greedy agreement (teacher-forced)",
             "free-running first divergence"], rows)])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse(argv)
        report = run(args)
    except accuracy.BadInput as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(table(report, argv))
    if args.json is not None:
        slim = {**report, "results": {name: {key: value for key, value in result.items()
                                             if key not in ("argmax", "forced")}
                                      for name, result in report["results"].items()}}
        args.json.write_text(json.dumps(slim, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
