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
Each folder is measured on the held-back text exactly as scripts/bench_kv_accuracy.py measures a
KV cache (`measure`: perplexity over non-overlapping windows, every row's argmax, greedy
continuations teacher-forced and free-running), each against the unchanged INT4 export.

Prints a markdown table with the commands, the CPU and the load average; --json writes every
number. `--quick` is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kv_accuracy as accuracy  # noqa: E402  (a script beside this one)
from _bench.harness import markdown_table  # noqa: E402
from _bench.models import BenchModelMissing, model_folder  # noqa: E402

from onnx_chunk.passes.int4_blocks import INT4_BLOCK_SIZES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench-out" / "int4-accuracy"
REFERENCE = "block 32 (as exported)"


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
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder for the converted models (default bench-out/int4-accuracy)")
    accuracy.add_held_out_arguments(parser)
    args = parser.parse_args(argv)
    accuracy.check_held_out_arguments(args)
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


def run(args: argparse.Namespace) -> dict:
    folder = _folder(args.model)
    float_folder = None if args.float_model == "none" else _folder(args.float_model)
    held = accuracy.read_held_out(args)
    ids, windows, prompts = accuracy.held_out_inputs(folder, held, args)
    args.out.mkdir(parents=True, exist_ok=True)
    arms: list[tuple[str, Path, list[str]]] = [(REFERENCE, folder, [])]
    arms += [(f"block {size}", folder, ["--int4-block-size", str(size)])
             for size in args.blocks]
    if args.int8_matmul:
        arms.append(("int8 matmul", folder, ["--int8-matmul"]))
    if float_folder is not None:
        arms.append(("float32 weights", float_folder, []))
    load_before = accuracy.load_average()
    results: dict[str, dict[str, Any]] = {}
    commands: dict[str, str] = {}
    for name, source, options in arms:
        converted, command = accuracy.convert(source, args.out, name.split(" (")[0], options)
        commands[name] = " ".join(["onnx-chunk", *command[3:]])
        results[name] = accuracy.measure(converted, windows, prompts, args.new_tokens,
                                         results.get(REFERENCE), args.chunk_size, args.threads)
        print(f"{name}: perplexity {results[name]['perplexity']:.4f} "
              f"({results[name]['seconds']} s)", file=sys.stderr, flush=True)
    return {"model": str(folder), "float_model": str(float_folder) if float_folder else None,
            "cpu": accuracy.cpu_description(), "load_before": load_before,
            "load_after": accuracy.load_average(), "windows": len(windows),
            "window": args.window, "chunk_size": args.chunk_size, "held_out_tokens": len(ids),
            "prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "convert_commands": commands, "results": results}


def table(report: dict, argv: list[str]) -> str:
    results = report["results"]
    base = results[REFERENCE]
    floor = results.get("float32 weights")
    rows = []
    for name, result in results.items():
        rows.append([name, f"{result['perplexity']:.4f}",
                     f"{result['perplexity'] / base['perplexity']:.4f}",
                     f"{result['perplexity'] / floor['perplexity']:.4f}" if floor else "-",
                     f"{100 * result['row_agreement']:.1f}%",
                     f"{100 * result['greedy_agreement']:.1f}%",
                     accuracy.divergence(result["first_divergence"], report["new_tokens"])])
    return "\n".join([
        "`" + " ".join(["python scripts/bench_int4_accuracy.py", *argv]) + "`",
        f"CPU: {report['cpu']}; load average {report['load_before']} before, "
        f"{report['load_after']} after.",
        f"Held-back text: {report['held_out_tokens']} tokens, {report['windows']} windows of "
        f"{report['window']} (prefill chunks of {report['chunk_size']}); greedy: "
        f"{report['prompts']} prompts of {report['prompt_tokens']} tokens, "
        f"{report['new_tokens']} new tokens each. Agreement is with {REFERENCE}.",
        "", markdown_table(
            ["weights", "perplexity", "ratio to block 32", "ratio to float32",
             "row argmax = block 32", "greedy agreement (teacher-forced)",
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
